"""What the LoRA registry raises; api/status.py maps each to a gRPC status code."""

from __future__ import annotations


class LoraRejected(ValueError):
    """An adapter we cannot serve as given: `field` names what is wrong (an
    adapter_config.json field, a file, a flag, or the request's lora_adapter)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class LoraDisabled(RuntimeError):
    """An adapter was named, but the scheduler runs without --enable-lora."""


class LoraAdapterExists(RuntimeError):
    """load_lora_adapter: the name is registered already."""


class LoraAdapterNotFound(LookupError):
    """unload_lora_adapter: no adapter of that name."""
