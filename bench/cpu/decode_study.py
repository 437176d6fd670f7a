"""Where one CPU decode step of the default model goes, and what each idea of issue 25
gives, measured side by side in one process (phase A's study, before the worker
changed; its forward now takes the fused ops, see bench/cpu/worker_step.py for the
worker's own step). Prints JSON lines; bench/results/cpu_decode_study.md is written
from them.

Sections (--only to run some):
  linears   every Linear of a step on one token: F.linear on plain weights, oneDNN-packed
            (the worker's bf16 path), MKL-packed fp32, and per-layer unfused vs fused QKV /
            gate-up; GB/s of weights streamed
  step      the worker's DecoderModel forward on one token (context 256) with the reference
            attention vs the C++ paged attention, eager, at 1 and 2 threads, plus a
            torch.profiler split of the step by op family
  compile   torch.compile of the same forward (dynamic batch; default mode and
            max-autotune-no-cudagraphs; freezing), cold compile time and the step time
  batch     steps at 1 / 8 / 32 / 64 sequences (context 256 and 1,024): reference vs C++ attention

    python -m bench.cpu.decode_study --only linears step
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import cpu_ops, reference
from worker_svc.models.decoder import DecoderModel
from worker_svc.models.linear import Linear

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "SmolLM2-135M-Instruct"
BLOCK = 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def cpu_line() -> str:
    from svc_common.cpu_features import read_cpu_features

    return read_cpu_features().describe()


def clock() -> Callable[[], float]:
    """With one torch thread every op runs on this thread, so its CPU time is the cost,
    unmoved by the other sessions sharing the machine; with more, wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def best_of(fn: Callable[[], object], reps: int, rounds: int = 5) -> float:
    """Seconds per call: the best round's mean over `reps` calls (after one warm call),
    the round least disturbed by the other sessions on this machine."""
    now = clock()
    fn()
    out = []
    for _ in range(rounds):
        start = now()
        for _ in range(reps):
            fn()
        out.append((now() - start) / reps)
    return min(out)


# ---- linears -----------------------------------------------------------------------------
@functools.cache
def prototype_gemv() -> bool:
    """bench/cpu/gemv_prototype.cpp built like the product kernels (kernels/cpu_build.py)."""
    from kernels import cpu_build
    from kernels.build_cache import Library

    source = REPO / "bench" / "cpu" / "gemv_prototype.cpp"
    Library("pagedserve_proto_gemv", (source,), cflags=cpu_build.CFLAGS, ldflags=cpu_build.LDFLAGS).load()
    return True


def linear_variants(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"F.linear": lambda x: F.linear(x, weight)}
    if prototype_gemv():
        variants["C++ GEMV (prototype)"] = lambda x: torch.ops.pagedserve_proto.gemv(x, weight)
    if weight.dtype == torch.bfloat16:
        for hint in (1, 32):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
            variants[f"onednn packed (hint {hint})"] = lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(
                x, p, None, "none", [], ""
            )
    if weight.dtype == torch.float32 and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
        bias = torch.zeros(weight.shape[0])
        variants["mkl packed"] = lambda x, p=packed, b=bias, w=weight: torch.ops.mkl._mkl_linear(x, p, w, b, 1)
        packed_dnn = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        variants["onednn packed (hint 1)"] = lambda x, p=packed_dnn: torch.ops.mkldnn._linear_pointwise(
            x, p, None, "none", [], ""
        )
    return variants


def study_linears(model: DecoderModel, dtype_name: str) -> None:
    """One token through every Linear of a step, per variant (weights as the worker holds
    them plain: fused qkv and gate_up), and fused vs unfused for one layer's projections."""
    dtype = DTYPES[dtype_name]
    spec = model.spec
    hidden, inter = spec.hidden_size, spec.intermediate_size
    plain = []
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            plain.append(_plain_weight(lin, dtype))
    plain.append(model.embed)
    total_bytes = sum(w.numel() * w.element_size() for w in plain)
    names = list(linear_variants(plain[0]))
    for name in names:
        fns = [(linear_variants(w)[name], w.shape[1]) for w in plain]
        xs = {k: torch.randn(1, k).to(dtype) for k in {hidden, inter}}

        def run(fns=fns, xs=xs) -> None:
            for fn, k in fns:
                fn(xs[k])

        seconds = best_of(run, 3)
        emit(
            section="linears",
            dtype=dtype_name,
            variant=name,
            ms=seconds * 1e3,
            gbs=total_bytes / seconds / 1e9,
            mb=total_bytes / 1e6,
            threads=torch.get_num_threads(),
        )
    # One layer's projections, fused as the worker holds them vs split as in the checkpoint.
    layer = model.layers[0]
    qkv, gate_up = _plain_weight(layer.qkv, dtype), _plain_weight(layer.gate_up, dtype)
    q, k, v = qkv.split([spec.num_q_heads * spec.head_dim, *(2 * [spec.num_kv_heads * spec.head_dim])])
    gate, up = gate_up.split([inter, inter])
    x = torch.randn(1, hidden).to(dtype)
    for name in names:
        fused = [linear_variants(w)[name] for w in (qkv, gate_up)]
        split = [linear_variants(w.contiguous())[name] for w in (q, k, v, gate, up)]
        for label, fns_ in (("fused qkv + gate_up", fused), ("split q, k, v, gate, up", split)):
            seconds = best_of(lambda fns_=fns_: [fn(x) for fn in fns_], 50)
            emit(section="fusion", dtype=dtype_name, variant=name, layout=label, us=seconds * 1e6)


def _plain_weight(lin, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight in `dtype` (a packed oneDNN weight is unpacked through a matmul
    with the identity: exact, since each output is one weight times 1)."""
    if not lin.packed:
        return lin.weight.to(dtype)
    eye = torch.eye(lin.in_features, dtype=torch.bfloat16)
    return torch.ops.mkldnn._linear_pointwise(eye, lin.weight, None, "none", [], "").t().contiguous()


# ---- a decode step -----------------------------------------------------------------------
class PagedAttention:
    """The attention callable DecoderModel.forward takes: write K/V at the batch's slots,
    then decode attention over the paged cache, through `ops` (reference or cpu_ops)."""

    def __init__(self, ops, model: DecoderModel, num_seqs: int, context: int, dtype: torch.dtype):
        spec = model.spec
        blocks_per_seq = -(-(context + 1) // BLOCK)
        num_blocks = num_seqs * blocks_per_seq + 1
        shape = (spec.num_layers, num_blocks, spec.num_kv_heads, BLOCK, spec.head_dim)
        self.k = torch.randn(shape).to(dtype)
        self.v = torch.randn(shape).to(dtype)
        self.ops = ops
        self.tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, blocks_per_seq) + 1
        self.context_lens = torch.full((num_seqs,), context, dtype=torch.int32)
        pos = context - 1
        self.slots = (self.tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).contiguous()
        self.scale = spec.head_dim**-0.5

    def __call__(self, layer: int, q, k, v, cos, sin, window: int):
        k_cache, v_cache = self.k[layer], self.v[layer]
        q, _ = self.ops.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, self.slots)
        return self.ops.paged_decode_attention(q, k_cache, v_cache, self.tables, self.context_lens, self.scale, window)


def step_fn(model: DecoderModel, attention: PagedAttention, num_seqs: int, context: int):
    ids = torch.randint(100, 40000, (num_seqs,))
    positions = torch.full((num_seqs,), context - 1, dtype=torch.long)

    def step() -> torch.Tensor:
        with torch.inference_mode():
            hidden = model.forward(ids, positions, attention)
            return model.logits(hidden)

    return step


OP_FAMILIES = {
    "linear (weights)": ("linear", "addmm", "mm", "matmul", "_linear_pointwise", "_mkl_linear", "gemv"),
    "attention": ("scaled_dot_product", "_scaled_dot_product", "paged_attention", "index_select", "_softmax"),
    "kv write": ("index_put",),
    "rms_norm": ("rms_norm",),
    "rope / elementwise": ("mul", "add", "cat", "neg", "cos", "sin", "silu", "sub", "slice", "to", "copy_", "_to_copy"),
}


def profile_split(step: Callable[[], object]) -> tuple[dict[str, float], dict[str, float]]:
    """Self CPU time of one step by op family and the 10 costliest ops, in ms
    (torch.profiler, 5 steps averaged)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    split: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key.split("::")[-1]
        family = next((f for f, keys in OP_FAMILIES.items() if any(name.startswith(k) for k in keys)), "other ops")
        split[family] += event.self_cpu_time_total / 1e3 / 5
        ops[event.key] = event.self_cpu_time_total / 1e3 / 5
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10])
    return dict(split), top


def study_step(model: DecoderModel, dtype_name: str, context: int = 256) -> None:
    dtype = DTYPES[dtype_name]
    threads_wanted = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for label, ops in (("reference attention", reference), ("C++ paged attention", cpu_ops)):
            step = step_fn(model, PagedAttention(ops, model, 1, context, dtype), 1, context)
            seconds = best_of(step, 5)
            record = dict(section="step", dtype=dtype_name, attention=label, threads=threads, ms=seconds * 1e3)
            if threads == 1:
                record["split_ms"], record["top_ops_ms"] = profile_split(step)
            emit(**record)
    torch.set_num_threads(threads_wanted)


def study_batch(model: DecoderModel, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    for context in (256, 1024):
        for num_seqs in (1, 8, 32, 64):
            for label, ops in (("reference attention", reference), ("C++ paged attention", cpu_ops)):
                step = step_fn(model, PagedAttention(ops, model, num_seqs, context, dtype), num_seqs, context)
                seconds = best_of(step, 2, rounds=3)
                emit(
                    section="batch", dtype=dtype_name, attention=label, seqs=num_seqs, context=context,
                    ms=seconds * 1e3, tok_s=num_seqs / seconds,
                )  # fmt: skip


# ---- torch.compile ------------------------------------------------------------------------
class CompiledAttention(PagedAttention):
    """The C++ op, and a K/V write with no host sync (the reference's write checks for
    skipped slots on the host, a graph break)."""

    def __call__(self, layer: int, q, k, v, cos, sin, window: int):
        k_cache, v_cache = self.k[layer], self.v[layer]
        q, k = reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)
        blocks, offsets = self.slots // BLOCK, self.slots % BLOCK
        k_cache[blocks, :, offsets] = k
        v_cache[blocks, :, offsets] = v
        return torch.ops.pagedserve_cpu.paged_attention(
            q, k_cache, v_cache, self.tables, None, self.context_lens, self.scale, window, None, None, None, None
        )


def study_compile(model: DecoderModel, dtype_name: str, modes: list[str], context: int = 256) -> None:
    import torch._dynamo
    import torch._inductor.config as inductor_config

    dtype = DTYPES[dtype_name]
    cpu_ops.available()  # builds the op and registers its fake (shape) function for tracing
    # Inductor cannot lower oneDNN's pre-packed weights (mkldnn._linear_pointwise on a packed
    # tensor): compile over plain weights, which Inductor packs itself when freezing.
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, Linear(_plain_weight(getattr(layer, name), dtype), pack=False))
    model.lm_head = Linear(_plain_weight(model.lm_head, dtype), pack=False)
    eager = step_fn(model, PagedAttention(cpu_ops, model, 1, context, dtype), 1, context)
    emit(section="compile", dtype=dtype_name, mode="eager (C++ attention)", ms=best_of(eager, 5) * 1e3)
    for mode in modes:
        torch._dynamo.reset()
        freezing = mode.endswith("+freezing")
        inductor_config.freezing = freezing
        compiled_forward = torch.compile(model.forward, dynamic=True, mode=mode.removesuffix("+freezing"))
        attention = CompiledAttention(cpu_ops, model, 1, context, dtype)
        ids = torch.randint(100, 40000, (1,))
        positions = torch.full((1,), context - 1, dtype=torch.long)

        def step(ids=ids, positions=positions, attention=attention, fwd=compiled_forward) -> torch.Tensor:
            with torch.inference_mode():
                return model.logits(fwd(ids, positions, attention))

        start = time.perf_counter()
        try:
            step()
        except Exception as exc:  # a mode that fails to compile here is a finding too
            emit(section="compile", dtype=dtype_name, mode=mode, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        compile_s = time.perf_counter() - start
        emit(section="compile", dtype=dtype_name, mode=mode, compile_s=compile_s, ms=best_of(step, 5) * 1e3)
    inductor_config.freezing = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=["linears", "step", "batch", "compile"])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: CPU time of this thread is measured, see clock())"
    )
    parser.add_argument("--compile-modes", nargs="+", default=["default", "max-autotune-no-cudagraphs"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    emit(section="machine", cpu=cpu_line(), torch=torch.__version__, threads=torch.get_num_threads(),
         load=open("/proc/loadavg").read().split()[:3])  # fmt: skip
    for dtype_name in args.dtypes:
        model = DecoderModel.load(MODEL_DIR, DTYPES[dtype_name], torch.device("cpu"))
        if "linears" in args.only:
            study_linears(model, dtype_name)
        if "step" in args.only:
            study_step(model, dtype_name)
        if "batch" in args.only:
            study_batch(model, dtype_name)
        if "compile" in args.only:
            study_compile(model, dtype_name, args.compile_modes)
    emit(section="end", load=open("/proc/loadavg").read().split()[:3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
