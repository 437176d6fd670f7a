"""Tiny PEFT LoRA adapters for the tiny checkpoints, built offline by PEFT itself.

An adapter test is only as good as its adapter: PEFT initialises B to zero, so a
freshly made adapter is the base model. Here both A and B are redrawn (seeded), so
every adapted projection really changes the logits, and the files are the ones
`PeftModel.save_pretrained` writes (adapter_config.json + adapter_model.safetensors),
names and all.

    ensure_adapter("llama", "r4_qv")      # -> .cache/tiny_checkpoints/adapters/llama/r4_qv
    build_adapter(base_dir, out_dir, AdapterSpec(rank=4, alpha=8, target_modules=("q_proj",)))
    python -m tools.tiny_adapters --family llama [--adapter r4_qv ...]

The oracle for an adapter is transformers + PEFT on the merged model
(`merged_model(base_dir, adapter_dir)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import zlib
from pathlib import Path
from typing import Any

from tools.tiny_checkpoints import DEFAULT_ROOT, build_once, ensure_checkpoint

VERSION = "1"
MARKER = ".tiny_adapter_version"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# A's and B's spread (the base's weights are drawn at 0.3 too): large enough that
# every adapter changes greedy tokens, small enough not to drown the base.
A_STD = 0.3
B_STD = 0.3


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    use_rslora: bool = False


# The test set: different ranks, scalings and target modules, so one mixed batch
# exercises padding to the largest rank, rsLoRA, fused qkv / gate_up and untouched
# projections in the same step.
ADAPTERS: dict[str, AdapterSpec] = {
    "r4_qv": AdapterSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj")),
    "r8_all_rslora": AdapterSpec(rank=8, alpha=4, target_modules=ATTENTION + MLP, use_rslora=True),
    "r2_mlp": AdapterSpec(rank=2, alpha=6, target_modules=MLP),
    "r16_ko_down": AdapterSpec(rank=16, alpha=16, target_modules=("k_proj", "o_proj", "down_proj")),
}


def _randomize_lora(model: Any, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                std = A_STD if "lora_A" in name else B_STD
                p.copy_(std * torch.randn(p.shape, generator=gen))


def build_adapter(base_dir: Path, out_dir: Path, spec: AdapterSpec, seed: int = 0) -> Path:
    """Write a PEFT LoRA adapter of `spec` for the checkpoint at `base_dir` into `out_dir`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.target_modules),
        use_rslora=spec.use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    _randomize_lora(model, seed)
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def merged_model(base_dir: Path, adapter_dir: Path) -> Any:
    """transformers + PEFT's own answer for an adapter: the base with it merged in (fp32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def _is_current(path: Path) -> bool:
    try:
        return (path / MARKER).read_text().strip() == VERSION
    except OSError:
        return False


def ensure_adapter(family: str, adapter: str, root: Path | None = None) -> Path:
    """Return the adapter `adapter` (a key of ADAPTERS) for the tiny `family`, built once.

    Concurrency-safe as ensure_checkpoint is (build_once).
    """
    spec = ADAPTERS[adapter]
    root = Path(root or os.environ.get("PAGEDSERVE_TINY_CKPT_DIR") or DEFAULT_ROOT)
    base_dir = ensure_checkpoint(family, root)

    def build(tmp: Path) -> None:
        # crc32, not hash(): the same adapter on every run and every process.
        build_adapter(base_dir, tmp, spec, seed=zlib.crc32(f"{family}/{adapter}".encode()))
        (tmp / MARKER).write_text(VERSION + "\n")

    return build_once(root / "adapters" / family / adapter, build, _is_current)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write tiny PEFT LoRA adapters for the tiny checkpoints.")
    parser.add_argument("--family", required=True, help="the tiny base checkpoint's family (llama, qwen3, ...)")
    parser.add_argument("--adapter", action="append", choices=sorted(ADAPTERS), help="repeatable; default: all")
    parser.add_argument("--out", type=Path, help="cache root (default: .cache/tiny_checkpoints)")
    args = parser.parse_args(argv)
    import structlog

    log = structlog.get_logger()
    for adapter in args.adapter or ADAPTERS:
        path = ensure_adapter(args.family, adapter, args.out)
        log.info("tiny_adapter", family=args.family, adapter=adapter, path=str(path))


if __name__ == "__main__":
    main()
