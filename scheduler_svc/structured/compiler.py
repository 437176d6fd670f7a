"""Constraint -> compiled grammar, with an LRU cache keyed by the constraint
and the vocabulary, and a bound on compile time.

llguidance builds its lexer lazily, so "compiling" here means constructing the
matcher (the grammar's parse, the JSON schema's translation, the lexer's start)
and computing its first mask: both are paid once per distinct constraint and
kept in a template matcher that every request deep-copies (~5-100 us). The
construction drops the GIL, so it runs on a small thread pool, never on the
event loop; a compile that errs or outlasts the bound is ConstraintRejected
naming the field. Before that, a constraint must keep within GrammarLimits
(limits.py) and compile in the sandbox's child process (sandbox.py): the native
compiler can crash on a deep grammar. llguidance's own limits (lexer fuel,
grammar size) bound the work a grammar can cost even after the caller gave up
waiting for it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy

from scheduler_svc.structured.bitmask import allowed_count
from scheduler_svc.structured.constraint import Constraint, ConstraintKind
from scheduler_svc.structured.errors import ConstraintRejected
from scheduler_svc.structured.limits import GrammarLimits
from scheduler_svc.structured.vocab import GrammarVocab

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from scheduler_svc.structured.sandbox import CompileSandbox

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (a template matcher each: KBs to a few MB)
DEFAULT_COMPILE_TIMEOUT_S = 5.0
COMPILE_THREADS = 2
MAX_ERROR_CHARS = 600

# JSON as json.dumps writes it: one space after ':' and ','; no other
# whitespace, so a weak model cannot pad forever with newlines.
JSON_STYLE: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class CompiledGrammar:
    constraint: Constraint
    vocab: GrammarVocab
    template: llguidance.LLMatcher  # at the grammar's start, first mask computed; never advanced
    compile_s: float

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    size: int = 0


class GrammarCompiler:
    """One per vocabulary (the scheduler has one model). Thread-safe."""

    def __init__(
        self,
        vocab: GrammarVocab,
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        limits: llguidance.LLParserLimits | None = None,
        grammar_limits: GrammarLimits = GrammarLimits(),
        sandbox: CompileSandbox | None = None,
    ) -> None:
        """`sandbox`: where a new constraint is tried first (the service always has one);
        without, compiles run in this process only (tests, benchmarks of the compiler)."""
        assert cache_size >= 1 and timeout_s > 0
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.limits = grammar_limits
        self._sandbox = sandbox
        # A cold compile runs twice with a sandbox (there, then here), each bounded by timeout_s.
        self._wait_s = timeout_s * (2 if sandbox is not None else 1)
        self._cache_size = cache_size
        self._limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        # Finished compiles (a grammar, or the ConstraintRejected it raised) and
        # compiles under way, so concurrent requests with one constraint compile it once.
        self._done: OrderedDict[tuple[str, Constraint], Future[CompiledGrammar]] = OrderedDict()
        self._running: dict[tuple[str, Constraint], Future[CompiledGrammar]] = {}
        self.stats = CacheStats()

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Blocking: the compiled grammar, or ConstraintRejected."""
        try:
            return self._submit(constraint).result(self._wait_s)
        except FutureTimeout:
            raise self._too_slow(constraint) from None

    async def compile_async(self, constraint: Constraint) -> CompiledGrammar:
        """The same, waiting without blocking the event loop."""
        future = asyncio.wrap_future(self._submit(constraint))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self._wait_s)
        except TimeoutError:
            raise self._too_slow(constraint) from None

    def forget(self, constraint: Constraint) -> None:
        """Drop a compiled grammar from the cache. Its matchers share the lexer states the template
        builds lazily; once one of them hit a limit (GrammarFailed) the states are spent for every
        later copy, so the next request with this constraint compiles afresh."""
        with self._lock:
            if self._done.pop((self.vocab.key, constraint), None) is not None:
                self.stats.size = len(self._done)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.close()

    def _too_slow(self, constraint: Constraint) -> ConstraintRejected:
        return ConstraintRejected(constraint.field, f"the grammar took longer than {self.timeout_s:g} s to compile")

    def _submit(self, constraint: Constraint) -> Future[CompiledGrammar]:
        key = (self.vocab.key, constraint)
        with self._lock:
            future = self._done.get(key)
            if future is not None:
                self._done.move_to_end(key)
                self.stats.hits += 1
                return future
            future = self._running.get(key)
            if future is not None:
                return future
            self.stats.misses += 1
            future = self._running[key] = self._pool.submit(self._build, constraint)
        # Outside the lock: a compile already done calls back at once, in this thread.
        future.add_done_callback(lambda f: self._finished(key, f))
        return future

    def _finished(self, key: tuple[str, Constraint], future: Future[CompiledGrammar]) -> None:
        with self._lock:
            self._running.pop(key, None)
            exc = None if future.cancelled() else future.exception()
            if future.cancelled() or (exc is not None and not isinstance(exc, ConstraintRejected)):
                return  # not the constraint's fault: the next request tries again
            self._done[key] = future
            while len(self._done) > self._cache_size:
                self._done.popitem(last=False)
            self.stats.size = len(self._done)

    def _build(self, constraint: Constraint) -> CompiledGrammar:
        start = time.perf_counter()
        self.limits.check(constraint)
        if self._sandbox is not None:
            self._sandbox.check(constraint)  # a crash ends a child there, not this process
        matcher = build_matcher(self.vocab, constraint, self._limits)
        return CompiledGrammar(constraint, self.vocab, matcher, time.perf_counter() - start)


def build_matcher(
    vocab: GrammarVocab, constraint: Constraint, limits: llguidance.LLParserLimits | None = None
) -> llguidance.LLMatcher:
    """The constraint's matcher at its start with its first mask computed (the sandbox's
    child runs exactly this), or ConstraintRejected."""
    grammar = llguidance_grammar(constraint)
    limits = limits or llguidance.LLParserLimits(verbose_errors=False)
    matcher = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0, limits=limits)
    first = llguidance.numpy.allocate_token_bitmask(1, vocab.vocab_size)
    if not matcher.is_error():
        llguidance.numpy.fill_next_token_bitmask(matcher, first)
    if matcher.is_error():
        raise ConstraintRejected(constraint.field, clip_error(matcher.get_error()))
    if allowed_count(first[0], vocab.vocab_size) == 0:
        raise ConstraintRejected(constraint.field, "the grammar allows no token of this model's vocabulary")
    return matcher


def llguidance_grammar(constraint: Constraint) -> str:
    """The constraint as llguidance's grammar text (not yet checked: the matcher does that)."""
    try:  # llguidance's translators refuse with ValueError (a schema past serde's nesting bound, a bad regex)
        return _translate(constraint)
    except ValueError as exc:
        raise ConstraintRejected(constraint.field, clip_error(str(exc))) from None


def _translate(constraint: Constraint) -> str:
    match constraint.kind:
        case ConstraintKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(
                constraint.text, defaults=JSON_STYLE, overrides={"lenient": not constraint.strict}
            )
        case ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
        case ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(constraint.text)
        case ConstraintKind.CHOICE:
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        case ConstraintKind.GRAMMAR:  # Lark passes through; GBNF (`::=`) is translated to Lark first
            return llguidance.grammar_from("grammar", constraint.text)


def clip_error(message: str) -> str:
    message = message.split("\n<state>")[0].strip()  # llguidance appends its parser state and the grammar
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."
