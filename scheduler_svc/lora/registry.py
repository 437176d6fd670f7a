"""The adapters requests may name (--lora-modules, admin.v1 LoadLoraAdapter), and the
bytes of the most recently used --max-cpu-loras of them kept in memory; the others are
read again from their directory when a worker needs them (and must not have changed)."""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

import structlog

from scheduler_svc.lora.adapter import AdapterFiles, read_adapter
from scheduler_svc.lora.errors import LoraAdapterExists, LoraAdapterNotFound, LoraRejected
from scheduler_svc.request import LoraRef

log = structlog.get_logger(__name__)

# A name is what OpenAI clients send as `model`: no spaces, no `=` (--lora-modules NAME=PATH).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    digest: str  # of its files: part of its identity (LoraRef)

    @property
    def ref(self) -> LoraRef:
        return LoraRef(self.name, self.digest)


class LoraRegistry:
    def __init__(self, max_lora_rank: int, max_cpu_loras: int, reserved_names: frozenset[str] = frozenset()) -> None:
        """reserved_names: what a request's `model` already means (the base model's names)."""
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.reserved_names = reserved_names
        self.adapters: dict[str, LoraAdapter] = {}
        self._bytes: OrderedDict[LoraRef, AdapterFiles] = OrderedDict()  # least recently used first

    def register(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter at `path`; raises LoraRejected, LoraAdapterExists."""
        if not _NAME.fullmatch(name):
            raise LoraRejected("lora_name", f"{name!r} must be 1-128 of letters, digits and ._:/@+- (no spaces, no =)")
        if name in self.reserved_names:
            raise LoraRejected("lora_name", f"{name!r} is the base model's name")
        if name in self.adapters:
            raise LoraAdapterExists(
                f"lora_name: an adapter {name!r} is loaded already (from {self.adapters[name].path})"
            )
        files, summary = read_adapter(path, self.max_lora_rank)
        adapter = LoraAdapter(name, path, summary.rank, summary.target_modules, files.digest)
        self.adapters[name] = adapter
        self._keep(adapter.ref, files)
        log.info("lora adapter registered", name=name, path=path, rank=summary.rank, modules=summary.target_modules)
        return adapter

    def unregister(self, name: str) -> LoraAdapter:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraAdapterNotFound(f"lora_name: no adapter {name!r} (loaded: {self._known()})")
        self._bytes.pop(adapter.ref, None)
        log.info("lora adapter unregistered", name=name)
        return adapter

    def resolve(self, name: str) -> LoraRef:
        """A request's adapter by name; raises LoraRejected naming lora_adapter."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoraRejected("lora_adapter", f"no adapter {name!r} (loaded: {self._known()})")
        return adapter.ref

    def current(self, ref: LoraRef) -> bool:
        """The adapter is still registered with the same files."""
        adapter = self.adapters.get(ref.name)
        return adapter is not None and adapter.digest == ref.digest

    def files(self, ref: LoraRef) -> AdapterFiles:
        """The adapter's bytes for a worker; raises LoraRejected if it was unloaded, or
        its directory changed since it was registered."""
        if not self.current(ref):
            raise LoraRejected("lora_adapter", f"adapter {ref.name!r} was unloaded")
        if (kept := self._bytes.get(ref)) is not None:
            self._bytes.move_to_end(ref)
            return kept
        adapter = self.adapters[ref.name]
        files, _ = read_adapter(adapter.path, self.max_lora_rank)
        if files.digest != ref.digest:
            raise LoraRejected("lora_path", f"{adapter.path!r} changed since adapter {ref.name!r} was loaded")
        self._keep(ref, files)
        return files

    def _keep(self, ref: LoraRef, files: AdapterFiles) -> None:
        self._bytes[ref] = files
        self._bytes.move_to_end(ref)
        while len(self._bytes) > self.max_cpu_loras:
            self._bytes.popitem(last=False)

    def _known(self) -> str:
        return ", ".join(sorted(self.adapters)) or "none"
