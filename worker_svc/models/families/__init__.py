"""One module per family; importing this package registers them all (registry.py)."""

from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.families import gemma, granite, llama, mistral, moe, olmo2, phi3, qwen
from worker_svc.models.registry import FAMILIES, Family

__all__ = ["gemma", "granite", "llama", "mistral", "moe", "olmo2", "phi3", "qwen", "family_of", "listing"]


def family_of(model_type: str) -> Family:
    if model_type not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedModel(f"model_type {model_type!r} is not supported (supported: {supported})")
    return FAMILIES[model_type]


def listing() -> str:
    """One line per family: its model_type and checkpoints users run (--list-architectures)."""
    width = max(len(t) for t in FAMILIES)
    return "".join(f"{t:<{width}}  {FAMILIES[t].examples}\n" for t in sorted(FAMILIES))
