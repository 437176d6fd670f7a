"""Bounds a constraint must keep before it is compiled at all: its size, its
rule count and how deeply it nests. llguidance's compiler recurses natively, so
a grammar past these (a chain of 3,000 rules, a 10,000-level schema) overflows
its stack and kills the process; these checks are the cheap first line, the
compile sandbox (sandbox.py) the second. Each refusal names the field, the
limit and the flag that sets it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from scheduler_svc.structured.constraint import Constraint, ConstraintKind
from scheduler_svc.structured.errors import ConstraintRejected

# Defaults: a 1,000-rule chain compiles in 3 MiB of stack (measured, llguidance 1.9), under
# the sandbox's 4 MiB; real grammars (SQL, JSON, a tool-call format) have tens to hundreds.
DEFAULT_MAX_CHARS = 128 * 1024
DEFAULT_MAX_RULES = 1000
DEFAULT_MAX_DEPTH = 64

# A Lark rule or terminal starts a line: `name:`, `?name:`, `!name:`, `NAME.2:`; GBNF's `name ::=`.
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:(?![:=])", re.MULTILINE)
_GBNF_RULE = re.compile(r"::=")
_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = frozenset(_OPEN.values())
# Where brackets are text, not structure: JSON strings, Lark literals (a regex has no quotes).
_QUOTE = {ConstraintKind.JSON_SCHEMA: '"', ConstraintKind.GRAMMAR: '"'}


@dataclass(frozen=True)
class GrammarLimits:
    max_chars: int = DEFAULT_MAX_CHARS
    max_rules: int = DEFAULT_MAX_RULES
    max_depth: int = DEFAULT_MAX_DEPTH

    def check(self, constraint: Constraint) -> None:
        """ConstraintRejected naming the field and the limit if `constraint` is past one."""
        field = constraint.field
        text = "".join(constraint.choices) if constraint.kind is ConstraintKind.CHOICE else constraint.text
        if len(text) > self.max_chars:
            raise ConstraintRejected(
                field, f"{len(text)} characters, over the limit of {self.max_chars} (--max-grammar-chars)"
            )
        if constraint.kind is ConstraintKind.GRAMMAR:
            rules = len(_LARK_RULE.findall(text)) + len(_GBNF_RULE.findall(text))
            if rules > self.max_rules:
                raise ConstraintRejected(
                    field, f"{rules} rules, over the limit of {self.max_rules} (--max-grammar-rules)"
                )
        if constraint.kind in (ConstraintKind.CHOICE, ConstraintKind.JSON_OBJECT):
            return  # literals, compiled flat
        depth = nesting_depth(text, _QUOTE.get(constraint.kind, ""))
        if depth > self.max_depth:
            raise ConstraintRejected(
                field, f"nested {depth} levels deep, over the limit of {self.max_depth} (--max-grammar-depth)"
            )


def nesting_depth(text: str, quote: str = "") -> int:
    """The deepest nesting of (), [] and {} in `text`, iteratively (the point is to
    never recurse on untrusted text). Backslash escapes one character; inside `quote`
    strings (a JSON string, a Lark literal) brackets are text, not structure."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_string:
            in_string = char != quote
        elif quote and char == quote:
            in_string = True
        elif char in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif char in _CLOSE:
            depth = max(depth - 1, 0)
    return deepest
