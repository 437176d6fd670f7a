"""The LoRA flags, named as vLLM's (--enable-lora, --lora-modules, --max-loras,
--max-lora-rank, --max-cpu-loras); SchedulerConfig inherits them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class LoraFlags:
    enable_lora: bool = field(
        default=False,
        metadata={
            "help": "serve LoRA adapters: a request names one (serving.v1 lora_adapter; OpenAI's model) and runs "
            "through it, mixed with base requests in the same steps; every worker needs --enable-lora too"
        },
    )
    lora_modules: str = field(
        default="",
        metadata={
            "help": "adapters to register at start-up, NAME=PATH each (a PEFT adapter directory: adapter_config.json "
            "and adapter_model.safetensors), space- or comma-separated; more at run time through admin.v1 "
            "LoadLoraAdapter (the gateway's /v1/load_lora_adapter)",
            "nargs": "+",
        },
    )
    max_loras: int = field(
        default=1,
        metadata={
            "help": "adapters resident on each worker at once (its slots; the least recently used adapter no "
            "running request uses is evicted for another); at most the worker's own --max-loras"
        },
    )
    max_lora_rank: int = field(default=16, metadata={"help": "the largest adapter rank accepted"})
    max_cpu_loras: int = field(
        default=0,
        metadata={
            "help": "adapters whose files the scheduler keeps in memory to send to workers (the others are read "
            "again from their directory); 0 = --max-loras"
        },
    )

    def lora_checks(self) -> list[tuple[bool, str, str]]:
        """(ok, flag, what it must be), as SchedulerConfig.validate reads them."""
        modules = self.lora_module_paths
        return [
            (self.max_loras >= 1, "--max-loras", ">= 1"),
            (self.max_lora_rank >= 1, "--max-lora-rank", ">= 1"),
            (self.max_cpu_loras == 0 or self.max_cpu_loras >= self.max_loras, "--max-cpu-loras", "0 or >= --max-loras"),
            (self.enable_lora or not self.lora_modules, "--lora-modules", "used with --enable-lora"),
            (
                all(name and path for name, path in modules),
                "--lora-modules",
                f"NAME=PATH entries, got {self.lora_modules!r}",
            ),
            *(
                (os.path.isdir(path), "--lora-modules", f"an existing adapter directory for {name} (got {path!r})")
                for name, path in modules
                if name and path
            ),
            (
                len({name for name, _ in modules}) == len(modules),
                "--lora-modules",
                "NAME=PATH entries with distinct names",
            ),
        ]

    @property
    def lora_module_paths(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path) pairs; an entry without `=` is ("", entry)."""
        entries = self.lora_modules.replace(",", " ").split()
        return [tuple(e.split("=", 1)) if "=" in e else ("", e) for e in entries]  # type: ignore[misc]

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras
