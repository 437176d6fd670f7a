"""What the compile sandbox costs (issue 35, item 1): a new constraint compiles
first in a child process (scheduler_svc/structured/sandbox.py), then again in the
scheduler; a cached one never leaves the scheduler. On the default model's
tokenizer (49,152 ids), per real schema (bench/structured_schemas.py) and a Lark
grammar, measured side by side in one run, interleaved per constraint:

* cold compile in-process only (the path before issue 35);
* cold compile through the sandbox (child + in-process), the child already started;
* warm compile (a cache hit) with the sandbox in place.

    python -m bench.structured_compile [--rounds 5]

Each cold figure is the median over --rounds compiles after forget() (the cache emptied of it);
the sandbox's child is started once, before timing (its start-up, with the
vocabulary built in it, is reported apart: the first constrained request pays it
alongside the scheduler's own vocabulary build).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.harness.machine import announce, load_average, rss_mb
from bench.harness.results import markdown_table, write_result
from bench.harness.services import DEFAULT_MODEL
from bench.structured_schemas import REAL_SCHEMAS
from scheduler_svc.structured import Constraint, GrammarCompiler, GrammarVocab
from scheduler_svc.structured.sandbox import CompileSandbox, SandboxVocab
from scheduler_svc.text.tokenizer import load_tokenizer

NAME = "structured_compile"
LARK = 'start: "{" pair ("," pair)* "}"\npair: KEY ":" VALUE\nKEY: /"[a-z]{1,8}"/\nVALUE: /[0-9]{1,6}/\n'


def compile_ms(compiler: GrammarCompiler, constraint: Constraint) -> float:
    start = time.perf_counter()
    compiler.compile(constraint)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    announce(NAME)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    load_before = time.perf_counter(), load_average()
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    vocab = GrammarVocab.from_model_tokenizer(tokenizer)
    sandbox_vocab = SandboxVocab(tokenizer.tokenizer.to_str(), vocab.vocab_size, vocab.eos_token_ids)
    started = time.perf_counter()
    sandbox = CompileSandbox(sandbox_vocab, timeout_s=30.0)
    sandbox.wait_ready()
    startup_ms = (time.perf_counter() - started) * 1e3
    child_rss = rss_mb(sandbox._idle[0].proc.pid)
    constraints = {name: Constraint.json_schema(json.dumps(schema)) for name, schema in REAL_SCHEMAS.items()}
    constraints["lark (4 rules)"] = Constraint.grammar(LARK)
    alone, boxed = GrammarCompiler(vocab), GrammarCompiler(vocab, sandbox=sandbox)
    rows = []
    for name, constraint in constraints.items():
        cold_plain, cold_boxed, warm_us = [], [], []
        for _ in range(args.rounds):  # forget(): the cache emptied of it, the next compile is cold
            alone.forget(constraint)
            cold_plain.append(compile_ms(alone, constraint))
            boxed.forget(constraint)
            cold_boxed.append(compile_ms(boxed, constraint))
            warm_us.append(compile_ms(boxed, constraint) * 1e3)
        p, b = statistics.median(cold_plain), statistics.median(cold_boxed)
        rows.append(
            [name, f"{p:.1f}", f"{b:.1f}", f"{b - p:.1f}", f"{b / p:.1f}x", f"{statistics.median(warm_us):.0f}"]
        )
    alone.close()
    boxed.close()  # and the sandbox
    table = markdown_table(
        [
            "constraint",
            "cold, in-process only (ms)",
            "cold, sandbox + in-process (ms)",
            "added by the sandbox (ms)",
            "ratio",
            "warm, cache hit (us)",
        ],
        rows,
    )
    notes = (
        f"Tokenizer of `{DEFAULT_MODEL.name}` ({vocab.vocab_size} ids). Medians of {args.rounds} rounds, the two cold "
        f"paths interleaved per round. The sandbox's child: started and ready in {startup_ms:.0f} ms (its own "
        f"vocabulary build included; the first constrained request pays it while the scheduler builds its own), "
        f"RSS {child_rss:.0f} MB; it stays up between compiles (a round trip over a pipe per new constraint). "
        f"1-minute load average {load_before[1]:.1f} before, {load_average():.1f} after (2 cores, shared with other "
        "work: absolute figures are inflated, the columns are measured side by side)."
    )
    print(table + "\n\n" + notes)
    write_result(NAME, "Cold grammar compiles with and without the compile sandbox", table, notes)


if __name__ == "__main__":
    main()
