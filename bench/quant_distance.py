"""How far each engine's greedy tokens move from the dequantized reference, on the same
GGUF file (issue 38: quantizing activations for integer dot products is allowed only
as a measured choice, stated next to llama.cpp's own distance on that file).

The reference: transformers fp32 on the file (`from_pretrained(..., gguf_file=...)`:
the blocks dequantized with the gguf package), in this process, one prompt at a time,
argmax at every step. Beside it, greedy (temperature 0) on the same token ids:

* pagedserve's worker serving the file (`--model FILE.gguf --dtype float32`), driven
  step by step by the scheduler's own planner (bench/harness/step_driver.py), once
  with its defaults and once per --variants entry (worker flags: by default
  `--quant-activations none`, the fp32 path, and `int8`, x quantized per 32-block for
  integer dot products as llama.cpp does); a worker that refuses a variant's flags
  (or fails on them) gives a "skipped" row naming what it said, and the run goes on;
* llama.cpp's server on the file (its `/completion` endpoint, token ids in and out).

Every output ends before its first end-of-sequence token (llama.cpp stops there; its
ignore_eos would mask those logits, another argmax than the reference's). Per engine:
the fraction of the reference's tokens it reproduced at the same position, the mean
position of the first token that differs (the reference's length where none does), and
how many prompts came out identical. The Q8_0 and Q4_K_M files (llama-quantize's output,
bench/harness/llama_cpp.py) make the fp32 rows an exactness check on a real quantizer's
blocks: pagedserve's fp32 path should reproduce every token there too, so that the int8
row's distance from the reference is its distance from the fp32 path as well.

    python -m bench.quant_distance                                   # every file, 8 prompts x 64 tokens
    python -m bench.quant_distance --files Q4_1 --prompts 2 --max-tokens 16   # a smoke run
    python -m bench.quant_distance --variants "int8 x=--quant-activations int8"
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.harness.llama_cpp import (
    GGUF_KINDS,
    completion_tokens,
    extract_sidecar,
    gguf_file,
    install_llama_cpp,
    llama_cpp,
)
from bench.harness.machine import announce, load_average
from bench.harness.openai_servers import CACHE, RunningServer, log
from bench.harness.results import markdown_table, write_result
from bench.harness.services import ServiceProcess
from bench.harness.step_driver import StepDriver

PORT = 18380  # bench.peers uses 18080 and 18180
# name=worker flags: each a pagedserve row beside the worker's defaults.
DEFAULT_VARIANTS = (
    "fp32 activations=--quant-activations none",
    "int8 activations=--quant-activations int8",
)


# ---- the distance -------------------------------------------------------------------------
def until_stop(tokens: list[int], stops: frozenset[int]) -> list[int]:
    """`tokens` up to (not including) the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i]
    return tokens


def first_divergence(tokens: list[int], reference: list[int]) -> int:
    """The first position where `tokens` differs from `reference` (one ending early
    differs there); len(reference) where they are equal."""
    for i, want in enumerate(reference):
        if i >= len(tokens) or tokens[i] != want:
            return i
    return len(reference)


@dataclass(frozen=True)
class Distance:
    identical_fraction: float  # of the reference's tokens, reproduced at the same position
    mean_first_divergence: float  # positions; the reference's length where none differs
    identical_prompts: int
    prompts: int


def distance(outputs: list[list[int]], references: list[list[int]]) -> Distance:
    same = sum(
        sum(1 for a, b in zip(out, ref, strict=False) if a == b) for out, ref in zip(outputs, references, strict=True)
    )
    total = sum(len(ref) for ref in references)
    firsts = [first_divergence(out, ref) for out, ref in zip(outputs, references, strict=True)]
    return Distance(
        identical_fraction=same / total if total else 1.0,
        mean_first_divergence=sum(firsts) / len(firsts),
        identical_prompts=sum(out == ref for out, ref in zip(outputs, references, strict=True)),
        prompts=len(references),
    )


# ---- the prompts and the reference --------------------------------------------------------
def make_prompts(tokenizer_json: Path, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` runs of `length` token ids of English prose (CPython's own docs)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(" ".join(topics[k] for k in sorted(topics))).ids
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - length) for _ in range(count)]
    return [ids[s : s + length] for s in starts]


def reference_tokens(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers fp32 on the GGUF, one prompt at a time (a batch would change the
    matmuls' summation order), argmax at every step, max_tokens each."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    torch.set_num_threads(1)  # a 1-row forward gains little from more, and loses much on a shared machine
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            step = model(torch.tensor([prompt]), use_cache=True)
            tokens = [int(step.logits[0, -1].argmax())]
            while len(tokens) < max_tokens:
                step = model(torch.tensor([[tokens[-1]]]), past_key_values=step.past_key_values, use_cache=True)
                tokens.append(int(step.logits[0, -1].argmax()))
            out.append(tokens)
    return out


# ---- the engines --------------------------------------------------------------------------
def pagedserve_tokens(
    path: Path, prompts: list[list[int]], max_tokens: int, stops: frozenset[int], flags: list[str]
) -> list[list[int]]:
    """The worker on the GGUF with `flags`, greedy, every prompt at once, stopping at an
    end-of-sequence token. Raises RuntimeError (the worker's output) where it refuses."""
    from scheduler_svc.request import Request, SamplingOptions

    args = ["--model", str(path), "--dtype", "float32", "--num-blocks", "512", *flags]
    with ServiceProcess("worker_svc", args, timeout_s=600) as worker:
        driver = StepDriver(worker.address, max_num_seqs=len(prompts), prefix_caching=False)
        try:
            sampling = SamplingOptions(temperature=0.0, max_tokens=max_tokens)
            requests = [Request(f"q{i}", i, list(p), sampling, stops) for i, p in enumerate(prompts)]
            driver.add(requests)
            while driver.planner.has_work():
                driver.step()
        finally:
            driver.close()
    return [list(r.output_token_ids) for r in requests]


def llamacpp_tokens(kind: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    # One thread: ggml gives each output row to one thread, so the tokens do not depend on
    # the count, and one thread does not wait on descheduled others on a shared machine.
    server = llama_cpp(PORT, kind, slots=1, slot_tokens=len(prompts[0]) + max_tokens + 16, threads=1)
    running = RunningServer(server, CACHE / "logs" / f"quant_distance_{server.name.replace(' ', '_')}.log")
    try:
        running.wait_ready(300)
        return [completion_tokens(server, prompt, max_tokens) for prompt in prompts]
    finally:
        running.stop()


def refusal(error: Exception) -> str:
    """The last line a refusing worker wrote (its error), or the status of the step it
    failed, for the report."""
    text = error.details() if isinstance(error, grpc.Call) else str(error)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(error).__name__


# ---- the run ------------------------------------------------------------------------------
def measure_file(kind: str, args: argparse.Namespace) -> list[list[str]]:
    from scheduler_svc.text.tokenizer import load_tokenizer
    from svc_common.gguf_sidecar import model_files

    path = gguf_file(kind)
    extract_sidecar(path)
    tokenizer_dir = model_files(path)
    stops = frozenset(load_tokenizer(tokenizer_dir).eos_token_ids)
    prompts = make_prompts(tokenizer_dir / "tokenizer.json", args.prompts, args.prompt_tokens)
    log(f"{kind}: the reference (transformers fp32), {len(prompts)} prompts x {args.max_tokens} tokens")
    references = [until_stop(t, stops) for t in reference_tokens(path, prompts, args.max_tokens)]
    rows = []

    def row(engine: str, outputs: list[list[int]]) -> None:
        d = distance([until_stop(t, stops) for t in outputs], references)
        rows.append(
            [
                kind,
                engine,
                f"{d.identical_fraction:.1%}",
                f"{d.mean_first_divergence:.1f}",
                f"{d.identical_prompts} / {d.prompts}",
            ]
        )
        log(f"{kind} | {engine}: {d}")

    for name, flags in [("pagedserve (worker defaults)", ""), *(v.split("=", 1) for v in args.variants)]:
        engine = f"pagedserve {name}" if not name.startswith("pagedserve") else name
        engine += f" `{flags}`" if flags else ""
        try:
            row(engine, pagedserve_tokens(path, prompts, args.max_tokens, stops, flags.split()))
        except (RuntimeError, grpc.RpcError) as err:  # refused at start, or a step failed
            rows.append([kind, engine, "skipped", "", f"the worker refused: {refusal(err)}"])
            log(f"{kind} | {engine}: skipped ({refusal(err)})")
    if not args.no_llamacpp:
        row("llama.cpp server (temperature 0)", llamacpp_tokens(kind, prompts, args.max_tokens))
    return rows


def report(args: argparse.Namespace, rows: list[list[str]], done: bool) -> None:
    body = (
        f"{args.prompts} prompts of {args.prompt_tokens} tokens (CPython's docs), {args.max_tokens} greedy tokens "
        "each, against transformers fp32 on the same GGUF (the dequantized reference). identical: the reference's "
        "tokens reproduced at the same position; first divergence: mean position of the first differing token "
        f"({args.max_tokens} = none differs).\n\n"
        + markdown_table(["file", "engine", "identical tokens", "mean first divergence", "prompts identical"], rows)
    )
    notes = f"Load average {'at the end' if done else 'so far (the run goes on)'}: {load_average():.2f}."
    notes += f"\n\n{args.notes}" if args.notes else ""
    title = "Token distance from the dequantized reference (issue 38)"
    print(write_result(args.out, title, body, notes, module="quant_distance").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="+", choices=GGUF_KINDS, default=list(GGUF_KINDS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--variants", nargs="*", default=list(DEFAULT_VARIANTS), help="NAME=WORKER FLAGS: pagedserve rows"
    )
    parser.add_argument("--no-llamacpp", action="store_true", help="pagedserve rows only (no llama.cpp build)")
    parser.add_argument("--out", default="quant_distance")
    parser.add_argument("--notes", default="", help="a paragraph for the report's notes (a smoke run, the load)")
    args = parser.parse_args(argv)
    announce("quant_distance")
    if not args.no_llamacpp or set(args.files) - {"Q4_1"}:
        install_llama_cpp()  # llama-quantize makes Q8_0 and Q4_K_M
    rows: list[list[str]] = []
    for kind in args.files:  # the results file rewritten after each file: a long run keeps what it measured
        rows += measure_file(kind, args)
        report(args, rows, done=kind == args.files[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
