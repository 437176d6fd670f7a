"""pagedserve embeddings vs transformers: embeddings/s at batch 1 and 64 on the same
prompts, in the same run.

    python -m bench.embeddings [--batches 1 64] [--repeats 3] [--dtype float32]

* pagedserve: a real worker process and a real scheduler process (--runner pooling,
  --no-prefix-caching: the same prompts come back every repeat) on loopback; the
  batch is N concurrent serving.v1 Embed calls (last token, normalised).
* transformers: the model's decoder in this process, batch N right-padded with an
  attention mask, the last real token's hidden state normalised, on a pool thread
  (as the worker runs its steps).
* Prompts: N passages of 20-120 words (fixed seed), tokenized once here; both get
  the same token ids. Rate = N / wall time; the systems alternate, the order
  flipping every repeat; medians shown, with the cosine of the two systems'
  embeddings (worst over the prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.harness.load import word_prompts
from bench.harness.machine import announce
from bench.harness.results import markdown_table, median, write_result
from bench.harness.services import DEFAULT_MODEL, Cluster, require_model
from proto import serving_pb2, serving_pb2_grpc

NAME = "embeddings"


async def _embed_all(address: str, prompts: list[list[int]]) -> list[np.ndarray]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = serving_pb2_grpc.SchedulerStub(channel)
        replies = await asyncio.gather(*(stub.Embed(serving_pb2.EmbedRequest(prompt_token_ids=p)) for p in prompts))
    return [np.asarray(r.embedding, dtype=np.float64) for r in replies]


def run_system(address: str, prompts: list[list[int]]) -> tuple[float, list[np.ndarray]]:
    start = time.perf_counter()
    vectors = asyncio.run(_embed_all(address, prompts))
    return time.perf_counter() - start, vectors


def run_transformers(model, prompts: list[list[int]], thread: ThreadPoolExecutor) -> tuple[float, list[np.ndarray]]:
    def embed() -> list[np.ndarray]:
        width = max(map(len, prompts))
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
        with torch.inference_mode():
            states = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = states[torch.arange(len(prompts)), mask.sum(1) - 1].double()
        return list(torch.nn.functional.normalize(last, dim=1).numpy())

    start = time.perf_counter()
    vectors = thread.submit(embed).result()
    return time.perf_counter() - start, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    require_model(Path(args.model))
    announce(NAME)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = word_prompts(max(args.batches))
    prompt_ids = [tokenizer(t)["input_ids"] for t in texts]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    rows = []
    scheduler_args = ["--runner", "pooling", "--no-prefix-caching"]
    with Cluster(Path(args.model), ["--dtype", args.dtype], scheduler_args) as cluster, ThreadPoolExecutor(1) as thread:
        run_system(cluster.address, prompt_ids[:2])  # warm-up: not measured
        run_transformers(model, prompt_ids[:2], thread)
        for n in args.batches:
            batch = prompt_ids[:n]
            ours, theirs, worst = [], [], 1.0
            for repeat in range(args.repeats):
                order = ("ours", "theirs") if repeat % 2 == 0 else ("theirs", "ours")
                for who in order:
                    if who == "ours":
                        seconds, mine = run_system(cluster.address, batch)
                        ours.append(n / seconds)
                    else:
                        seconds, ref = run_transformers(model, batch, thread)
                        theirs.append(n / seconds)
                worst = min(worst, *(float(a @ b) for a, b in zip(mine, ref, strict=True)))
            rows.append(
                [
                    n,
                    f"{median(ours):.1f}",
                    f"{median(theirs):.1f}",
                    f"{median(ours) / median(theirs):.2f}",
                    f"{worst:.6f}",
                    " / ".join(f"{x:.1f}" for x in ours),
                    " / ".join(f"{x:.1f}" for x in theirs),
                ]
            )
    headers = [
        "batch",
        "pagedserve emb/s",
        "transformers emb/s",
        "ratio",
        "min cosine",
        "ours per run",
        "theirs per run",
    ]
    notes = f"prompts: {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens; dtype {args.dtype}."
    path = write_result(NAME, "pagedserve vs transformers: embeddings/s", markdown_table(headers, rows), notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
