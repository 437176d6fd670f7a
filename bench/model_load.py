"""Peak memory while loading a checkpoint, against the checkpoint's size.

    python -m bench.model_load [--model DIR]

Each load runs in a fresh process: after the imports its peak RSS (VmHWM) is reset
(/proc/self/clear_refs), the model is built on the CPU, and the peak and final RSS
above the post-import baseline are read. Two loaders, side by side in one run:
`lazy` is the worker's (worker_svc/models/weights.py: each tensor read from its
file when the decoder takes it), `eager` reads the whole checkpoint first
(safetensors.torch.load_file) and then builds the same model from it, as the
loader before issue 37 did. Weights stay plain (no packing for the C++ kernels),
so the final model is the checkpoint's tensors in the target dtype.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.harness.machine import announce, peak_rss_mb, rss_mb
from bench.harness.results import markdown_table, write_result
from bench.harness.services import REPO, run_in_tree

DTYPES = ("float32", "bfloat16")


def dtypes() -> tuple[str, ...]:
    """bf16 only where the CPU multiplies it natively: elsewhere the plain Linear's
    oneDNN reorder of bf16 weights refuses to run (models/linear.py)."""
    from svc_common.cpu_features import read_cpu_features

    return DTYPES if read_cpu_features().native_bf16 else DTYPES[:1]


def child(model_dir: str, loader: str, dtype_name: str) -> None:
    import torch
    from safetensors.torch import load_file

    from worker_svc.models import DecoderModel, load_spec
    from worker_svc.models.weights import to_canonical

    dtype, cpu = getattr(torch, dtype_name), torch.device("cpu")
    load_spec(model_dir)  # transformers' config machinery imported before the baseline
    pid = os.getpid()
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = rss_mb(pid)
    if loader == "lazy":
        model = DecoderModel.load(model_dir, dtype, cpu)
    else:
        spec = load_spec(model_dir)
        tensors = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            tensors.update(load_file(path))
        to_canonical(spec, tensors)
        model = DecoderModel.from_tensors(spec, tensors, dtype, cpu)
    print(
        "RSS", json.dumps({"peak": peak_rss_mb(pid) - base, "final": rss_mb(pid) - base, "layers": len(model.layers)})
    )


def measure(model_dir: str, loader: str, dtype_name: str) -> dict[str, float]:
    """The load in a fresh process (its peak RSS is the load's alone)."""
    argv = ["-m", "bench.model_load", "--child", loader, dtype_name, "--model", model_dir]
    result: dict[str, float] = run_in_tree(REPO, argv, "RSS")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--child", nargs=2, metavar=("LOADER", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, *args.child)
        return
    announce("model_load")
    size_mb = sum(p.stat().st_size for p in Path(args.model).glob("*.safetensors")) / 2**20
    config = json.loads((Path(args.model) / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype") or "?"
    rows = []
    for dtype_name in dtypes():
        got = {loader: measure(args.model, loader, dtype_name) for loader in ("lazy", "eager")}
        for loader, r in got.items():
            rows.append(
                [dtype_name, loader, f"{r['peak']:.0f}", f"{r['final']:.0f}", f"{r['peak'] / size_mb:.2f}x"]
                + [f"{r['peak'] / got['eager']['peak']:.2f}x"]
            )
        print(rows[-2], rows[-1], flush=True)
    body = (
        f"checkpoint: `{Path(args.model).name}`, {size_mb:.0f} MiB of safetensors (stored as {stored})\n\n"
        + markdown_table(
            ["dtype", "loader", "peak MiB above baseline", "final MiB", "peak / checkpoint", "peak / eager peak"],
            rows,
        )
    )
    notes = (
        "Peak and final RSS are above the process's RSS after its imports. `lazy`: the worker's loader "
        "(one tensor read at a time); `eager`: the whole checkpoint read first, then the same model built."
    )
    print(write_result("model_load", "Peak RSS while loading a checkpoint", body, notes))


if __name__ == "__main__":
    main()
