"""One worker's adapter slots: slot 0 is the base model, slots 1..num_slots each hold
one adapter, least recently used first. Pure bookkeeping: the engine loads an adapter
through the worker (engine/adapter_loader.py) and records it here; the planner admits
a request only once its adapter is resident, and writes the slot in its rows.

An adapter is evicted only when no running request uses it and no waiting request is
about to. When every slot is in use and a request waits for another adapter, the least
recently used adapter with running requests is *closing*: it admits no new request, so
its slot frees once its running ones end and the waiting adapter gets it (no adapter
keeps a slot forever under steady traffic)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from scheduler_svc.request import LoraRef


@dataclass(frozen=True, slots=True)
class Placement:
    slot: int
    evicted: LoraRef | None  # the adapter the slot held, if any


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._held: OrderedDict[LoraRef, int] = OrderedDict()  # least recently used first
        self.closing: LoraRef | None = None
        self.loads = 0
        self.evictions = 0

    @property
    def resident(self) -> list[LoraRef]:
        """Least recently used first."""
        return list(self._held)

    def holds(self, ref: LoraRef) -> bool:
        return ref in self._held

    def slot(self, ref: LoraRef | None) -> int:
        """The slot a row of this adapter names (0: the base); the adapter must be resident."""
        return 0 if ref is None else self._held[ref]

    def admits(self, ref: LoraRef | None) -> bool:
        """A request of this adapter may start now."""
        return ref is None or (ref in self._held and ref != self.closing)

    def touch(self, ref: LoraRef | None) -> None:
        if ref is not None:
            self._held.move_to_end(ref)

    def place(self, running: Collection[LoraRef], waiting: Collection[LoraRef] = ()) -> Placement | None:
        """Where a new adapter goes: a free slot, else the slot of the least recently
        used adapter that no running request uses and no waiting request is about to
        (a closing adapter's waiting requests wait for it to come back); None if there
        is none, and then the least recently used adapter with running requests starts
        closing, so that its slot frees once they end."""
        taken = set(self._held.values())
        free = next((s for s in range(1, self.num_slots + 1) if s not in taken), None)
        if free is not None:
            return Placement(free, None)
        for ref in self._held:
            if ref not in running and (ref not in waiting or ref == self.closing):
                return Placement(self._held[ref], ref)
        if self.closing is None:
            self.closing = next((ref for ref in self._held if ref in running), None)
        return None

    def loaded(self, ref: LoraRef, placement: Placement) -> None:
        if placement.evicted is not None:
            del self._held[placement.evicted]
            self.evictions += 1
            if self.closing == placement.evicted:
                self.closing = None
        self._held[ref] = placement.slot
        self.loads += 1

    def reopen(self) -> None:
        """No request waits for a slot any more: the closing adapter takes requests again."""
        self.closing = None

    def clear(self) -> None:
        """The worker restarted: every slot is empty."""
        self._held.clear()
        self.closing = None
