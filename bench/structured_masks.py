"""Structured outputs on the scheduler's CPU: what llguidance's token masks cost
(scheduler_svc/structured), on the default model's tokenizer (49,152 ids) and
on the tiny checkpoints' (768 ids). No model: the tokens come from random walks
through each grammar (uniform over the allowed ids, so mostly inside free
strings, the costliest state), which is what a mask sees, whatever the weights.

    python -m bench.structured_masks [--steps 300] [--rounds 3]

A. Compile: the cold compile of each real schema (bench/structured_schemas.py:
   construct the matcher + its first mask; fresh compiler per round, lowest of
   --rounds), the cached compile (LRU hit) and the per-request copy.
B. Mask time per decode step, 1 row and 32 rows (32 matchers over the five
   schemas, each at its own position; a matcher that completes restarts):
   serial fills in the caller's thread vs llguidance's parallel fill
   (LLExecutor, GIL released) with 1 and 2 threads, vs MaskFiller.fill_async
   (on the filler's thread, awaited from an event loop: serial, and parallel);
   the variants run interleaved on the same rows, step by step, each first in turn. Plus the
   advance (consume the sampled token) per row.
C. Memory: the process RSS growth for the tokenizer, the compiled grammars and
   32 matchers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Callable

import numpy as np

from bench.harness.machine import announce, load_average, rss_mb
from bench.harness.results import markdown_table, write_result
from bench.harness.services import DEFAULT_MODEL
from bench.structured_schemas import REAL_SCHEMAS
from scheduler_svc.structured import (
    Constraint,
    GrammarCompiler,
    GrammarMatcher,
    GrammarVocab,
    MaskFiller,
    allowed_ids,
)
from scheduler_svc.text.tokenizer import load_tokenizer

NAME = "structured_masks"
ROWS = 32


def vocabularies() -> list[tuple[str, Callable[[], GrammarVocab]]]:
    from tools.tiny_checkpoints import train_tokenizer_json

    tiny_json = train_tokenizer_json()
    return [
        ("SmolLM2-135M (49,152 ids)", lambda: GrammarVocab.from_model_tokenizer(load_tokenizer(DEFAULT_MODEL))),
        ("tiny checkpoints (768 ids)", lambda: GrammarVocab(tiny_json, 768, [2])),
    ]


def compile_rows(vocab: GrammarVocab, rounds: int) -> list[list[str]]:
    rows = []
    for name, schema in REAL_SCHEMAS.items():
        constraint = Constraint.json_schema(schema)
        cold = []
        for _ in range(rounds):
            compiler = GrammarCompiler(vocab)
            start = time.perf_counter()
            grammar = compiler.compile(constraint)
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            compiler.compile(constraint)
            cached = time.perf_counter() - start
            compiler.close()
        start = time.perf_counter()
        for _ in range(100):
            GrammarMatcher(grammar)
        copy = (time.perf_counter() - start) / 100
        rows.append([name, f"{min(cold) * 1e3:.2f}", f"{cached * 1e6:.0f}", f"{copy * 1e6:.0f}"])
    return rows


class Walkers:
    """`count` matchers at their own positions in the real schemas, walked with random allowed tokens."""

    def __init__(self, compiler: GrammarCompiler, count: int, seed: int) -> None:
        self.grammars = [compiler.compile(Constraint.json_schema(s)) for s in REAL_SCHEMAS.values()]
        self.rng = random.Random(seed)
        self.vocab = compiler.vocab
        self.matchers = [self._fresh(i) for i in range(count)]
        for _ in range(40):  # spread the rows over their documents
            self.advance(self.masks_serial())

    def _fresh(self, i: int) -> GrammarMatcher:
        return GrammarMatcher(self.grammars[i % len(self.grammars)])

    def masks_serial(self) -> np.ndarray:
        bits = np.empty((len(self.matchers), self.vocab.mask_words), np.int32)
        for i, m in enumerate(self.matchers):
            m.fill_mask(bits[i])
        return bits

    def advance(self, bits: np.ndarray) -> float:
        """Advance every row with a random token its mask allows; the seconds the advances took."""
        spent = 0.0
        for i, m in enumerate(self.matchers):
            token = int(self.rng.choice(allowed_ids(bits[i], self.vocab.vocab_size)))
            start = time.perf_counter()
            if token in self.vocab.eos_token_ids:
                self.matchers[i] = self._fresh(i)
                continue
            m.advance(token)
            spent += time.perf_counter() - start
            if m.is_complete:
                self.matchers[i] = self._fresh(i)
        return spent


def fill_variants(
    walkers: Walkers, fillers: dict[int, MaskFiller], loop: asyncio.AbstractEventLoop
) -> dict[str, Callable[[], np.ndarray]]:
    return {
        "serial, caller's thread": walkers.masks_serial,
        "parallel fill, 1 thread": lambda: fillers[1].fill(walkers.matchers).bits,
        "parallel fill, 2 threads": lambda: fillers[2].fill(walkers.matchers).bits,
        "fill_async, serial (threads=0)": lambda: loop.run_until_complete(fillers[0].fill_async(walkers.matchers)).bits,
        "fill_async, parallel 2 threads": lambda: loop.run_until_complete(fillers[2].fill_async(walkers.matchers)).bits,
    }


def step_rows(vocab: GrammarVocab, steps: int) -> list[list[str]]:
    compiler = GrammarCompiler(vocab)
    fillers = {threads: MaskFiller(vocab.mask_words, threads=threads) for threads in (0, 1, 2)}
    loop = asyncio.new_event_loop()
    rows = []
    for count in (1, ROWS):
        walkers = Walkers(compiler, count, seed=count)
        variants = fill_variants(walkers, fillers, loop)
        if count == 1:  # below PARALLEL_MIN_ROWS fill() is the serial loop
            variants = {k: v for k, v in variants.items() if "1 thread" not in k}
        times: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        advance: list[float] = []
        names = list(variants)
        for step in range(steps):
            bits = None
            for name in names[step % len(names) :] + names[: step % len(names)]:  # each goes first in turn
                fill = variants[name]
                start, start_cpu = time.perf_counter(), time.process_time()
                out = fill()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                assert bits is None or np.array_equal(out, bits), name
                bits = out
            assert bits is not None
            advance.append(walkers.advance(bits) / count)
        for name, values in times.items():
            values.sort()
            rows.append(
                [
                    count,
                    name,
                    f"{statistics.median(values) * 1e3:.3f}",
                    f"{values[int(0.9 * len(values))] * 1e3:.3f}",
                    f"{values[-1] * 1e3:.2f}",
                    f"{statistics.median(values) / count * 1e6:.1f}",
                    f"{statistics.mean(cpu[name]) * 1e3:.3f}",
                    f"{statistics.median(advance) * 1e6:.1f}",
                ]
            )
    loop.close()
    for filler in fillers.values():
        filler.close()
    compiler.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="decode steps timed per row count")
    parser.add_argument("--rounds", type=int, default=3, help="cold compiles per schema (lowest kept)")
    args = parser.parse_args()
    announce(NAME)
    load_before = load_average()
    sections = []
    for label, make_vocab in vocabularies():
        before = rss_mb(os.getpid())
        start = time.perf_counter()
        vocab = make_vocab()
        vocab_s = time.perf_counter() - start
        vocab_mb = rss_mb(os.getpid()) - before
        compiled = compile_rows(vocab, args.rounds)
        stepped = step_rows(vocab, args.steps)
        grown = rss_mb(os.getpid()) - before
        text = (
            f"### {label}\n\nGrammar vocabulary (llguidance token trie) built in {vocab_s * 1e3:.0f} ms, "
            f"RSS +{vocab_mb:.1f} MB; after the compiles and the walks below RSS +{grown:.1f} MB in all.\n\n"
            "A. Compile per schema (cold: constructor + first mask, lowest of rounds)\n\n"
            + markdown_table(["schema", "cold compile ms", "cached compile us", "matcher copy us"], compiled)
            + "\n\nB. Mask time per decode step (median / p90 / max over the steps), interleaved variants\n\n"
            + markdown_table(
                [
                    "rows",
                    "variant",
                    "step median ms",
                    "step p90 ms",
                    "step max ms",
                    "per row us (median)",
                    "process CPU ms per step (mean, all threads)",
                    "advance per row us",
                ],
                stepped,
            )
        )
        print(text + "\n")
        sections.append(text)
    notes = (
        "Random walks are uniform over each mask's allowed ids, so rows sit mostly inside free strings "
        "(the costliest state for a mask: most of the vocabulary is allowed there); a trained model's "
        "output spends more time in keys and punctuation, where masks are cheaper. The max column shows "
        "llguidance building lexer states lazily the first time a state is reached (later requests "
        "with the same grammar reuse them). Wall times are on a shared 2-core machine (load average in "
        "the header): a thread hand-off waits for a core, which the parallel fill pays per step; process "
        "CPU time (all threads, mean) is the cost without that wait."
    )
    load = f"Load average (1 min) {load_before:.1f} before the run, {load_average():.1f} after."
    path = write_result(
        NAME, "Structured-output token masks (llguidance) per step", "\n\n".join(sections), load + " " + notes
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
