"""The scheduler's grammar engine for its one model: the vocabulary (built on
the first constrained request, off the event loop: ~1 s and 60 MB for a 49k
vocabulary, paid only by a scheduler that serves constraints), the compiler
with its cache and its compile sandbox, and the mask filler the engine cores share."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from scheduler_svc.structured.compiler import DEFAULT_COMPILE_TIMEOUT_S, CompiledGrammar, GrammarCompiler
from scheduler_svc.structured.constraint import Constraint
from scheduler_svc.structured.errors import ConstraintRejected
from scheduler_svc.structured.fill import MaskFiller
from scheduler_svc.structured.limits import GrammarLimits
from scheduler_svc.structured.matcher import GrammarMatcher
from scheduler_svc.structured.sandbox import DEFAULT_MEMORY_MB, CompileSandbox, SandboxVocab
from scheduler_svc.structured.vocab import GrammarVocab, mask_words
from scheduler_svc.text.tokenizer import ModelTokenizer


class Grammars:
    def __init__(
        self,
        tokenizer: ModelTokenizer,
        logits_width: int,
        limits: GrammarLimits = GrammarLimits(),
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        memory_mb: int = DEFAULT_MEMORY_MB,
    ) -> None:
        """`logits_width`: the workers' vocabulary, which a mask row must cover exactly.
        `limits`, `timeout_s`, `memory_mb`: what a constraint may cost to compile
        (limits.py; the sandbox's time and address-space bounds)."""
        self.tokenizer = tokenizer
        self.logits_width = logits_width
        self.limits = limits
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.mask_words = mask_words(logits_width)
        self.filler = MaskFiller(self.mask_words)
        self._compiler: asyncio.Future[GrammarCompiler] | None = None

    async def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar (cached), or ConstraintRejected naming the field."""
        return await (await self._get_compiler()).compile_async(constraint)

    def matcher(self, grammar: CompiledGrammar, after: str = "") -> GrammarMatcher:
        """A request's matcher; with `after` (a reasoning model's end tag) the grammar starts
        once the output has produced the ids that text encodes to."""
        activate_after: Sequence[int] = self.tokenizer.encode(after, add_special_tokens=False) if after else ()
        return GrammarMatcher(grammar, activate_after)

    def forget(self, constraint: Constraint) -> None:
        """A matcher of this grammar failed (GrammarFailed): compile it afresh next time."""
        if self._compiler is not None and self._compiler.done() and not self._compiler.exception():
            self._compiler.result().forget(constraint)

    @property
    def cache_size(self) -> int:
        """Compiled grammars kept (0 before the first constrained request)."""
        if self._compiler is None or not self._compiler.done() or self._compiler.exception():
            return 0
        return self._compiler.result().stats.size

    def close(self) -> None:
        self.filler.close()
        if self._compiler is not None and self._compiler.done() and not self._compiler.exception():
            self._compiler.result().close()

    async def _get_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = asyncio.ensure_future(asyncio.to_thread(self._build))
        return await asyncio.shield(self._compiler)

    def _build(self) -> GrammarCompiler:
        tokenizer = self.tokenizer
        sandbox_vocab = SandboxVocab(
            tokenizer.tokenizer.to_str(), self.logits_width, tuple(sorted(tokenizer.eos_token_ids))
        )
        sandbox = CompileSandbox(sandbox_vocab, self.timeout_s, self.memory_mb)  # its child starts meanwhile
        vocab = GrammarVocab(sandbox_vocab.tokenizer_json, self.logits_width, sandbox_vocab.eos_token_ids)
        if vocab.mask_words != self.mask_words:
            sandbox.close()
            raise ConstraintRejected(
                "structured_output",
                f"this model's tokenizer has {vocab.vocab_size} ids, more than its {self.logits_width} logits: "
                "constraints cannot be served",
            )
        sandbox.wait_ready()  # its start-up (seconds on a busy machine) is outside the compile bound
        return GrammarCompiler(vocab, timeout_s=self.timeout_s, grammar_limits=self.limits, sandbox=sandbox)
