"""The GPU worker at the hardware's pace (issue 17): `make bench-gpu`.

    python -m bench.gpu_serving [--streams 1 32 128 256] [--max-tokens 256] [--sections ...] [--quick]

Needs a CUDA GPU: without one it says so and exits 0, measuring nothing.

Workload (issue 17): a random-weight 1B Llama in bf16 (hidden 2048, 16 layers,
32 query / 8 KV heads, head_dim 64, intermediate 8192, tied embeddings) with the
default model's 49,152-token vocabulary and tokenizer (models/SmolLM2-135M-Instruct),
written once to .cache/gpu_bench_llama1b; prompts of 200-312 random token ids
(seeded); --max-tokens greedy tokens each with ignore_eos; 1/32/128/256 concurrent
streams. Sections (--sections picks some):

* kernels: paged decode GB/s (K+V bytes of the contexts / time) as % of a
  device-to-device copy (read + write bytes / time), at 1 sequence x 4k and 32k
  and 64 sequences x 1k-4k, with the split-KV heuristic and forced single-pass,
  beside torch SDPA over a contiguous cache; prefill TFLOP/s (causal: 2 matmuls x
  L^2/2 x d x heads x 2) of the Triton paged kernel vs torch SDPA (flash) on 4x4k
  and 1x8k at head_dim 64 and 128 (32 query / 8 KV heads). The L2 cache is
  flushed before every timed call; medians of CUDA-event timings.
* step: `Worker.step` in this process (no gRPC) for a decode step of 1 and 256
  sequences at ~428-token contexts, with CUDA graphs and --enforce-eager: wall
  time per step; the worker's own split (prepare = host batch + the one upload,
  forward = CPU launch time of the forward, sample = sampling + waiting for the
  GPU, as the step's only sync); GPU busy = kernel time from torch.profiler /
  wall time of unprofiled steps; kernels launched per step.
* serving: a real worker process (--device cuda) and scheduler process on
  loopback (prefix caching off, --max-num-seqs 256, --max-num-batched-tokens
  8192), N concurrent Generate streams (bench/loop.py's client): output tok/s =
  tokens / wall from the first call to the last token, ITL p50/p99. First on the
  fresh cluster: TTFT of the first 300-token request after one 16-token warm-up
  request, vs the median of 5 more ("warm").
* transformers: `generate` (static batch, left padding, min_new_tokens =
  max_new_tokens) and continuous batching (`generate_batch`, eos disabled) on the
  same checkpoint in this process, after the cluster is gone.

Writes bench/results/gpu_serving.md and gpu_serving.png, named with the GPU.
A section that fails is reported in the file (and the exit status is 1); the
others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.harness.cuda import cuda_median_ms, describe_gpu
from bench.harness.hf import generate_exactly, left_padded
from bench.harness.load import TimedStream, drive, random_prompts
from bench.harness.machine import announce
from bench.harness.results import fmt, markdown_table, percentile, pyplot, save_plot, write_result
from bench.harness.services import DEFAULT_MODEL, REPO, Cluster

NAME = "gpu_serving"
SECTIONS = ("kernels", "step", "serving", "transformers")
CHECKPOINT = REPO / ".cache" / "gpu_bench_llama1b"
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
MAX_MODEL_LEN = 2048  # the worker's --max-model-len: prompts + new tokens fit; a graph's tables are 128 blocks
PROMPT_LENS = (200, 312)
MAX_NUM_SEQS = 256
KV_CACHE_MB = 12288
SCHEDULER_FLAGS = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", "8192", "--no-prefix-caching"]
# Issue 17's targets (H100).
TARGETS = {
    "1 stream tok/s": 250,
    "256 streams tok/s": 25_000,
    "256 streams vs generate": 9.0,
    "decode step 256 ms": 6.0,
    "GPU busy 256": 0.8,
    "TTFT first / warm": 2.0,
    "decode 1x32k GB/s": 1500,
    "prefill vs SDPA": 0.8,
}


# --------------------------------------------------------------------------- the checkpoint


def llama_1b_config() -> dict:
    """The default model's config.json with the 1B shape (vocabulary, rope, eos kept)."""
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    config.update(LLAMA_1B, dtype="bfloat16")
    for key in ("_model_name_or_path", "transformers_version", "torch_dtype"):
        config.pop(key, None)
    return config


def llama_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor names and shapes (tied embeddings: no lm_head)."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def ensure_checkpoint() -> Path:
    """Random bf16 weights (normal, std 0.02; norms 1), seeded, written once."""
    from safetensors.torch import save_file

    config = llama_1b_config()
    stamp = CHECKPOINT / "config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == config and (CHECKPOINT / "model.safetensors").exists():
        return CHECKPOINT
    CHECKPOINT.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (DEFAULT_MODEL / name).exists():
            shutil.copy(DEFAULT_MODEL / name, CHECKPOINT / name)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, shape in llama_weight_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16).cpu()
    save_file(tensors, str(CHECKPOINT / "model.safetensors"), metadata={"format": "pt"})
    stamp.write_text(json.dumps(config, indent=2))
    return CHECKPOINT


def prompts_for(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    return random_prompts(n, seed, 100, vocab, PROMPT_LENS)


# --------------------------------------------------------------------------- figures


def decode_bytes(context_lens: list[int], kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V bytes a decode reads: every context position, every KV head."""
    return 2 * sum(context_lens) * kv_heads * head_dim * itemsize


def causal_flops(seq_lens: list[int], heads: int, head_dim: int) -> float:
    """QK^T and PV over the causal half: 2 matmuls x 2 flops x L^2/2 x d per head."""
    return sum(2 * 2 * n * n / 2 * head_dim * heads for n in seq_lens)


# --------------------------------------------------------------------------- kernels


def kernel_table(quick: bool) -> dict:
    reps = 5 if quick else 20
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    rng = random.Random(0)
    cases = [("1 x 4k", [4096]), ("1 x 32k", [32768]), ("64 x 1k-4k", [rng.randint(1024, 4096) for _ in range(64)])]
    return {
        "copy_gbs": _copy_gbs(reps, flush),
        "decode": [_decode_row(label, contexts, reps, flush) for label, contexts in cases],
        "prefill": [
            _prefill_row(label, lens, 32, 8, head_dim, reps, flush)
            for head_dim in (64, 128)
            for label, lens in (("4 x 4k", [4096] * 4), ("1 x 8k", [8192]))
        ],
    }


def _copy_gbs(reps: int, flush: torch.Tensor) -> float:
    """Device-to-device copy of 1 GiB: read + write bytes per second, in GB/s."""
    src = torch.empty(2**30, dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_median_ms(lambda: dst.copy_(src), reps, flush) / 1e6


def _decode_row(label: str, contexts: list[int], reps: int, flush: torch.Tensor) -> dict:
    """Paged decode at 32 query / 8 KV heads, head_dim 64, bf16, 16-token blocks in random order."""
    from kernels import reference
    from kernels import triton as triton_ops

    q_heads, kv_heads, head_dim, block = 32, 8, 64, 16
    blocks = [-(-c // block) for c in contexts]
    k_cache = torch.randn(sum(blocks), kv_heads, block, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(sum(blocks), device="cuda").to(torch.int32)
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = perm[start : start + n]
        start += n
    ctx = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    query = torch.randn(len(contexts), q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    splits = triton_ops.num_kv_splits(len(contexts), kv_heads, max(blocks) * block, triton_ops.num_sms(query.device))
    row: dict = {"case": label, "splits": splits}
    row["split_ms"] = cuda_median_ms(
        lambda: triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.125), reps, flush
    )
    row["single_ms"] = cuda_median_ms(
        lambda: triton_ops.split_kv_decode_attention(query, k_cache, v_cache, tables, ctx, 0.125, num_splits=1),
        reps,
        flush,
    )
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.125)
    got = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.125)
    row["max_err"] = float((got.float() - expected.float()).abs().max())
    if len(contexts) == 1:  # SDPA over a contiguous cache of the same K/V (issue 17's comparison)
        k = reference.gather_context(k_cache, tables)[:, :, : contexts[0]]
        v = reference.gather_context(v_cache, tables)[:, :, : contexts[0]]
        q4 = query[:, :, None]
        row["sdpa_ms"] = cuda_median_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=0.125, enable_gqa=True),
            reps,
            flush,
        )
    nbytes = decode_bytes(contexts, kv_heads, head_dim, 2)
    for key in ("split", "single", "sdpa"):
        if f"{key}_ms" in row:
            row[f"{key}_gbs"] = nbytes / row[f"{key}_ms"] / 1e6
    return row


def _prefill_row(label, lens, q_heads, kv_heads, head_dim, reps, flush) -> dict:
    from kernels import triton as triton_ops
    from worker_svc.attention.prefill_route import fresh_prefill_attention

    block, total = 16, sum(lens)
    blocks = [-(-n // block) for n in lens]
    query = torch.randn(total, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    k_cache = torch.zeros(sum(blocks), kv_heads, block, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.arange(sum(blocks), dtype=torch.int32, device="cuda").view(len(lens), -1)
    slots = torch.arange(total, device="cuda")
    triton_ops.write_kv(key, value, k_cache, v_cache, slots)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    q4 = query.view(len(lens), lens[0], q_heads, head_dim).transpose(1, 2)
    k4 = key.view(len(lens), lens[0], kv_heads, head_dim).transpose(1, 2)
    v4 = value.view(len(lens), lens[0], kv_heads, head_dim).transpose(1, 2)
    flops = causal_flops(lens, q_heads, head_dim)
    row = {"case": f"{label}, d{head_dim}"}
    row["triton_ms"] = cuda_median_ms(
        lambda: triton_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, scale), reps, flush
    )
    row["sdpa_ms"] = cuda_median_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True
        ),
        reps,
        flush,
    )
    row["routed_ms"] = cuda_median_ms(
        lambda: fresh_prefill_attention(query, key, value, cu, tuple(lens), scale), reps, flush
    )
    for name in ("triton", "sdpa", "routed"):
        row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
    return row


# --------------------------------------------------------------------------- worker step split


def step_split(model: Path, batch: int, graphs: bool, quick: bool) -> dict:
    result = _step_split(model, batch, graphs, quick)
    gc.collect()  # the worker (its cache, its graphs) is gone: give its memory back before the next
    torch.cuda.empty_cache()
    return result


def _step_split(model: Path, batch: int, graphs: bool, quick: bool) -> dict:
    from torch.autograd import DeviceType

    from worker_svc.config import WorkerConfig
    from worker_svc.step.builder import StepBuilder
    from worker_svc.step.input import StepInput
    from worker_svc.worker import Worker

    steps = 10 if quick else 30
    context = 428  # the workload's median prompt + half its new tokens
    per_seq = -(-(context + steps + 16) // 16)
    worker = Worker(
        WorkerConfig(
            model=str(model),
            dtype="bfloat16",
            device="cuda",
            num_blocks=batch * per_seq,
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=not graphs,
        )
    )
    vocab = worker.info.vocab_size
    prompts = [p[:context] + [5] * (context - len(p[:context])) for p in prompts_for(batch, vocab, seed=1)]
    tables = [[s * per_seq + b for b in range(per_seq)] for s in range(batch)]

    def step_of(step_id: int, rows: list[tuple[int, list[int], int]]) -> StepInput:
        """(sequence, tokens, start) per row, every row sampled."""
        builder = StepBuilder(block_size=16)
        for s, tokens, start in rows:
            builder.add(s, tokens, start, tables[s], sample=True)
        return builder.build(step_id)

    step_id = 0
    per_step = max(1, 8192 // context)
    for first in range(0, batch, per_step):  # prefill, 8192 tokens a step
        step_id += 1
        worker.step(step_of(step_id, [(s, prompts[s], 0) for s in range(first, min(batch, first + per_step))]))
    position = context
    tokens = [7] * batch

    def decode() -> dict:
        nonlocal step_id, position, tokens
        step_id += 1
        out = worker.step(step_of(step_id, [(s, [tokens[s]], position) for s in range(batch)]))
        position += 1
        tokens = out.samples.token_ids.tolist()
        return out.timings_ms

    for _ in range(3):
        decode()
    walls, timings = [], []
    for _ in range(steps):
        start = time.perf_counter()
        timings.append(decode())
        walls.append((time.perf_counter() - start) * 1e3)
    profiled = 5
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(profiled):
            decode()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    gpu_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / profiled
    wall = statistics.median(walls)
    return {
        "batch": batch,
        "graphs": worker.graphs_enabled,
        "wall_ms": wall,
        "gpu_ms": gpu_ms,
        "busy": gpu_ms / wall,
        "kernels": len(kernels) / profiled,
        **{k: statistics.median(t[k] for t in timings) for k in ("prepare_ms", "forward_ms", "sample_ms")},
    }


# --------------------------------------------------------------------------- serving


def serving(model: Path, streams: list[int], max_tokens: int) -> dict:
    from scheduler_svc.client import SchedulerClient

    worker_args = [
        "--device", "cuda", "--dtype", "bfloat16", "--kv-cache-memory-mb", str(KV_CACHE_MB),
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN),
    ]  # fmt: skip
    cluster = Cluster(model, worker_args, [*SCHEDULER_FLAGS, "--max-waiting", "2048"])
    for worker in cluster.workers:
        worker.timeout_s = 1200  # loading, graph capture and compiling before it serves
    started = time.perf_counter()
    out: dict = {"runs": {}}
    with cluster:
        out["start_s"] = time.perf_counter() - started
        vocab = llama_1b_config()["vocab_size"]
        with SchedulerClient(cluster.address) as client:
            ttft = []
            warm_up = prompts_for(1, vocab, seed=2)[0][:16]
            TimedStream(client, warm_up, 16).start().join()
            rng = random.Random(3)
            for _ in range(6):
                stream = TimedStream(client, [rng.randrange(100, vocab) for _ in range(300)], 16).start()
                stream.join()
                if stream.error or stream.first_token_at is None:
                    raise RuntimeError(f"TTFT request failed: {stream.error}")
                ttft.append((stream.first_token_at - stream.started_at) * 1e3)
        out["ttft_first_ms"], out["ttft_warm_ms"] = ttft[0], statistics.median(ttft[1:])
        for n in streams:
            result = asyncio.run(drive(cluster.address, prompts_for(n, vocab, seed=n), max_tokens))
            out["runs"][n] = {
                "tok_s": result.tok_s,
                "itl_p50": percentile(result.gaps_ms, 50),
                "itl_p99": percentile(result.gaps_ms, 99),
            }
            print(f"serving {n} streams: {out['runs'][n]['tok_s']:.0f} tok/s", flush=True)
    return out


# --------------------------------------------------------------------------- transformers


def transformers_generate(model: Path, streams: list[int], max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    pad = 0
    rates = {}
    for n in [1, *streams]:  # the first (1) warms up
        prompts = prompts_for(n, hf.config.vocab_size, seed=n)
        ids, mask = left_padded(prompts, pad, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        new = generate_exactly(hf, ids, mask, max_tokens, pad)
        torch.cuda.synchronize()
        rates[n] = new.numel() / (time.perf_counter() - start)
        print(f"transformers generate {n}: {rates[n]:.0f} tok/s", flush=True)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return rates


def transformers_continuous(model: Path, streams: list[int], max_tokens: int) -> dict:
    """generate_batch under the first attention implementation this transformers accepts."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    errors = []
    for implementation in ("paged|sdpa", "sdpa", "paged|eager"):
        try:
            hf = AutoModelForCausalLM.from_pretrained(
                model, dtype=torch.bfloat16, attn_implementation=implementation
            ).cuda().eval()  # fmt: skip
            config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            config.eos_token_id = -1  # ignore_eos: continuous batching treats -1 as no EOS
            rates = {"implementation": implementation}
            for n in [1, *streams]:
                prompts = prompts_for(n, hf.config.vocab_size, seed=n)
                torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.no_grad():  # not inference_mode: generate_batch's loop thread writes these tensors
                    results = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
                torch.cuda.synchronize()
                produced = sum(len(r.generated_tokens) for r in results.values())
                rates[n] = produced / (time.perf_counter() - start)
                rates[f"{n}_tokens"] = produced
                print(f"transformers generate_batch {n}: {rates[n]:.0f} tok/s", flush=True)
            del hf
            gc.collect()
            torch.cuda.empty_cache()
            return rates
        except Exception as exc:  # another transformers version: try the next implementation name
            errors.append(f"{implementation}: {type(exc).__name__}: {exc}")
            gc.collect()
            torch.cuda.empty_cache()
    raise RuntimeError("generate_batch failed under every implementation: " + " | ".join(errors))


# --------------------------------------------------------------------------- report


def report(args, results: dict, errors: dict, started: float) -> str:
    parts = [
        f"{describe_gpu()}. Streams {args.streams}, {args.max_tokens} new tokens, "
        f"prompts {PROMPT_LENS[0]}-{PROMPT_LENS[1]} tokens. Run time {time.perf_counter() - started:.0f} s."
    ]
    verdicts = []

    def verdict(name: str, value: float, higher: bool = True) -> None:
        goal = TARGETS[name]
        met = value >= goal if higher else value <= goal
        verdicts.append([name, f"{'>=' if higher else '<='} {goal:g}", fmt(value, 2), "met" if met else "**missed**"])

    serve, gen, cb = results.get("serving"), results.get("generate"), results.get("continuous")
    if serve or gen or cb:
        rows = []
        for n in args.streams:
            run = (serve or {}).get("runs", {}).get(n, {})
            rows.append(
                [
                    n,
                    fmt(run.get("tok_s", float("nan")), 0),
                    fmt((gen or {}).get(n, float("nan")), 0),
                    fmt((cb or {}).get(n, float("nan")), 0),
                    fmt(run.get("itl_p50", float("nan"))),
                    fmt(run.get("itl_p99", float("nan"))),
                ]
            )
        headers = ["streams", "pagedserve tok/s", "transformers generate tok/s"]
        headers += [f"transformers generate_batch ({(cb or {}).get('implementation', 'n/a')}) tok/s"]
        headers += ["pagedserve ITL p50 ms", "p99 ms"]
        parts.append("## Output tokens/s\n\n" + markdown_table(headers, rows))
        runs = (serve or {}).get("runs", {})
        if 1 in runs:
            verdict("1 stream tok/s", runs[1]["tok_s"])
        if 256 in runs:
            verdict("256 streams tok/s", runs[256]["tok_s"])
            if gen and 256 in gen:
                verdict("256 streams vs generate", runs[256]["tok_s"] / gen[256])
    if serve:
        ratio = serve["ttft_first_ms"] / serve["ttft_warm_ms"]
        parts.append(
            f"## First request\n\nWorker start to ready (load, graph capture, compile): {serve['start_s']:.1f} s. "
            f"TTFT of the first 300-token request after a 16-token warm-up: {serve['ttft_first_ms']:.1f} ms; "
            f"warm (median of 5): {serve['ttft_warm_ms']:.1f} ms; ratio {ratio:.2f}."
        )
        verdict("TTFT first / warm", ratio, higher=False)
    if steps := results.get("step"):
        rows = [
            [
                s["batch"],
                "graphs" if s["graphs"] else "eager",
                fmt(s["wall_ms"], 2),
                fmt(s["prepare_ms"], 2),
                fmt(s["forward_ms"], 2),
                fmt(s["sample_ms"], 2),
                fmt(s["gpu_ms"], 2),
                f"{100 * s['busy']:.0f}%",
                fmt(s["kernels"], 0),
            ]
            for s in steps
        ]
        headers = ["seqs", "mode", "Worker.step ms", "prepare ms", "forward (CPU launch) ms", "sample + GPU wait ms"]
        headers += ["GPU kernels ms", "GPU busy", "kernels/step"]
        parts.append("## Worker.step decode, in process\n\n" + markdown_table(headers, rows))
        for s in steps:
            if s["batch"] == 256 and s["graphs"]:
                verdict("decode step 256 ms", s["wall_ms"], higher=False)
                verdict("GPU busy 256", s["busy"])
    if kern := results.get("kernels"):
        copy = kern["copy_gbs"]
        rows = [
            [
                d["case"],
                d["splits"],
                f"{fmt(d['split_gbs'], 0)} ({100 * d['split_gbs'] / copy:.0f}%)",
                f"{fmt(d['single_gbs'], 0)} ({100 * d['single_gbs'] / copy:.0f}%)",
                fmt(d.get("sdpa_gbs", float("nan")), 0),
                f"{d['max_err']:.1e}",
            ]
            for d in kern["decode"]
        ]
        headers = ["paged decode", "splits", "split-KV GB/s (% of copy)", "single pass GB/s", "SDPA contiguous GB/s"]
        headers += ["max err vs reference"]
        parts.append(
            f"## Kernels\n\nDevice-to-device copy: {copy:.0f} GB/s (read + write).\n\n" + markdown_table(headers, rows)
        )
        rows = [
            [
                p["case"],
                fmt(p["triton_tflops"], 0),
                fmt(p["sdpa_tflops"], 0),
                fmt(p["routed_tflops"], 0),
                f"{p['triton_tflops'] / p['sdpa_tflops']:.2f}x",
            ]
            for p in kern["prefill"]
        ]
        headers = ["causal prefill", "Triton paged TFLOP/s", "SDPA TFLOP/s", "routed (worker's SDPA path) TFLOP/s"]
        headers += ["Triton / SDPA"]
        parts.append(markdown_table(headers, rows))
        long = next(d for d in kern["decode"] if d["case"] == "1 x 32k")
        verdict("decode 1x32k GB/s", long["split_gbs"])
        verdict("prefill vs SDPA", min(p["routed_tflops"] / p["sdpa_tflops"] for p in kern["prefill"]))
    if verdicts:
        parts.append("## Issue 17 targets\n\n" + markdown_table(["target", "goal", "measured", ""], verdicts))
    if errors:
        parts.append("## Failed sections\n\n" + "\n".join(f"* {k}: `{v}`" for k, v in errors.items()))
    return "\n\n".join(parts)


def plot(args, results: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    serve, gen, cb = results.get("serving"), results.get("generate"), results.get("continuous")
    xs = range(len(args.streams))
    width = 0.27
    series = [
        ("pagedserve", (serve or {}).get("runs", {}), lambda r: r["tok_s"]),
        ("transformers generate", gen or {}, lambda r: r),
        ("transformers generate_batch", cb or {}, lambda r: r),
    ]
    for k, (label, data, value) in enumerate(series):
        ys = [value(data[n]) if n in data else 0 for n in args.streams]
        axes[0].bar([x + (k - 1) * width for x in xs], ys, width, label=label)
    axes[0].set_xticks(list(xs), [f"{n} streams" for n in args.streams])
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title(f"{torch.cuda.get_device_name()}: 1B Llama bf16")
    axes[0].legend(fontsize=8)
    if kern := results.get("kernels"):
        labels = [d["case"] for d in kern["decode"]]
        axes[1].bar(labels, [100 * d["split_gbs"] / kern["copy_gbs"] for d in kern["decode"]], label="split-KV")
        axes[1].bar(labels, [100 * d["single_gbs"] / kern["copy_gbs"] for d in kern["decode"]], 0.4, label="single")
        axes[1].set_ylabel("% of device copy bandwidth")
        axes[1].set_title("paged decode")
        axes[1].legend(fontsize=8)
    save_plot(fig, NAME)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", help="default 1 32 128 256 (--quick: 1 32)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="32 tokens, fewer repetitions, streams 1 32 unless given")
    args = parser.parse_args(argv)
    announce(NAME)
    if not torch.cuda.is_available():
        print("bench.gpu_serving needs a CUDA GPU and this machine has none: nothing measured, nothing written.")
        return 0
    if args.quick:
        args.max_tokens = 32
    args.streams = args.streams or ([1, 32] if args.quick else [1, 32, 128, 256])
    started = time.perf_counter()
    model = ensure_checkpoint()
    results: dict = {}
    errors: dict = {}

    title = f"The GPU worker at the hardware's pace (issue 17) on {torch.cuda.get_device_name()}"

    def section(name: str, fn: Callable[[], object]) -> None:
        try:
            results[name] = fn()
        except Exception as exc:  # recorded in the report; the other sections still run
            traceback.print_exc()
            errors[name] = f"{type(exc).__name__}: {exc}"
        # Written after every section: a run cut short by its lease keeps what it measured.
        write_result(NAME, title, report(args, results, errors, started))

    if "kernels" in args.sections:
        section("kernels", lambda: kernel_table(args.quick))
    if "step" in args.sections:
        section("step", lambda: [step_split(model, b, g, args.quick) for b in (1, 256) for g in (True, False)])
    if "serving" in args.sections:
        section("serving", lambda: serving(model, args.streams, args.max_tokens))
    if "transformers" in args.sections:
        section("generate", lambda: transformers_generate(model, args.streams, args.max_tokens))
        section("continuous", lambda: transformers_continuous(model, args.streams, args.max_tokens))
    text = report(args, results, errors, started)
    print(text)
    plot(args, results)
    print(f"wrote {write_result(NAME, title, text)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
