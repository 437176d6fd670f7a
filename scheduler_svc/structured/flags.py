"""The structured-output flags: how a constrained request is planned (late masks) and
the bounds a constraint must keep (limits.py, sandbox.py); SchedulerConfig inherits them."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.structured.compiler import DEFAULT_COMPILE_TIMEOUT_S
from scheduler_svc.structured.limits import DEFAULT_MAX_CHARS, DEFAULT_MAX_DEPTH, DEFAULT_MAX_RULES, GrammarLimits
from scheduler_svc.structured.sandbox import DEFAULT_MEMORY_MB


@dataclass
class StructuredFlags:
    constrained_ahead: bool = field(
        default=True,
        metadata={
            "help": "structured outputs with async scheduling: plan a constrained request's next token ahead like any "
            "other, its token mask sent after it once the token it follows is known (late masks); "
            "--no-constrained-ahead: such a request is not planned ahead (it decodes every other step)"
        },
    )
    max_grammar_chars: int = field(
        default=DEFAULT_MAX_CHARS,
        metadata={"help": "longest structured-output constraint (JSON schema, regex, grammar, choices) in characters"},
    )
    max_grammar_rules: int = field(
        default=DEFAULT_MAX_RULES,
        metadata={
            "help": "most rules and terminals in a structured-output grammar (the compiler recurses through them: "
            "a 3,000-rule chain overflows its stack)"
        },
    )
    max_grammar_depth: int = field(
        default=DEFAULT_MAX_DEPTH,
        metadata={
            "help": "deepest nesting of (), [] and {} in a structured-output grammar, regex or JSON schema "
            "(a schema level is two: the object and its properties)"
        },
    )
    grammar_compile_timeout_s: float = field(
        default=DEFAULT_COMPILE_TIMEOUT_S,
        metadata={
            "help": "longest a new constraint may take to compile, in the compile sandbox and then again in the "
            "scheduler (a cold compile runs in both)"
        },
    )
    grammar_compile_memory_mb: int = field(
        default=DEFAULT_MEMORY_MB,
        metadata={"help": "address-space limit of the compile sandbox's child process (the vocabulary included)"},
    )

    @property
    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(self.max_grammar_chars, self.max_grammar_rules, self.max_grammar_depth)

    def structured_checks(self) -> list[tuple[bool, str, str]]:
        """(ok, flag, what it must be), as SchedulerConfig.validate reads them."""
        return [
            (self.max_grammar_chars >= 1, "--max-grammar-chars", ">= 1"),
            (self.max_grammar_rules >= 1, "--max-grammar-rules", ">= 1"),
            (self.max_grammar_depth >= 1, "--max-grammar-depth", ">= 1"),
            (self.grammar_compile_timeout_s > 0, "--grammar-compile-timeout-s", "> 0"),
            (self.grammar_compile_memory_mb >= 256, "--grammar-compile-memory-mb", ">= 256"),
        ]
