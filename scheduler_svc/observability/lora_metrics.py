"""LoRA series, read at scrape time (--enable-lora only): requests running and waiting
per adapter, each worker's resident adapters, loads and evictions, and vLLM's
`vllm:lora_requests_info` (value: the scrape's Unix time, as vLLM sets it; the adapters
in comma-separated labels, as routers such as the Gateway API Inference Extension read
them)."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from scheduler_svc.observability.names import LORA_METRIC_NAMES

if TYPE_CHECKING:
    from scheduler_svc.engine.core import EngineCore

_PER_ADAPTER = ("worker", "adapter")


def lora_families(cores: list[EngineCore]) -> list[Metric]:
    running = _gauge("pagedserve_lora_requests_running", _PER_ADAPTER)
    waiting = _gauge("pagedserve_lora_requests_waiting", _PER_ADAPTER)
    resident = _gauge("pagedserve_lora_adapter_resident", ("worker", "adapter", "slot"))
    loads = _counter("pagedserve_lora_adapter_loads")
    evictions = _counter("pagedserve_lora_adapter_evictions")
    load_seconds = _counter("pagedserve_lora_adapter_load_seconds")
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        LORA_METRIC_NAMES["vllm:lora_requests_info"],
        labels=["model_name", "engine", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    now = time.time()
    for core in cores:
        slots = core.planner.adapters
        if slots is None:
            continue
        w = core.info.address
        on = Counter(r.lora.name for r in core.planner.running if r.lora is not None)
        queued = Counter(r.lora.name for r in core.planner.waiting if r.lora is not None)
        for counts, family in ((on, running), (queued, waiting)):
            for name, count in sorted(counts.items()):
                family.add_metric([w, name], count)
        for ref in slots.resident:
            resident.add_metric([w, ref.name, str(slots.slot(ref))], 1)
        loads.add_metric([w], slots.loads)
        evictions.add_metric([w], slots.evictions)
        load_seconds.add_metric([w], core.counters.adapter_load_ms / 1e3)
        labels = [core.info.model_name, w, str(slots.num_slots), ",".join(sorted(on)), ",".join(sorted(queued))]
        info.add_metric(labels, now)
    return [running, waiting, resident, loads, evictions, load_seconds, info]


def _gauge(name: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, LORA_METRIC_NAMES[name], labels=list(labels))


def _counter(name: str) -> CounterMetricFamily:
    return CounterMetricFamily(name, LORA_METRIC_NAMES[name + "_total"], labels=["worker"])
