"""Servers side by side in rounds (bench.peers --rounds): every server up at once, each
workload driven on each server in turn, round after round, with fresh prompts per round
(no prefix cache serves a later round). One server after another puts minutes between
two figures, and on a shared VM the machine's speed moves by 10 % in minutes; in rounds
every server meets the same stretches, and each figure is the median over rounds."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from bench.harness.machine import load_average
from bench.harness.openai_servers import HttpServer, RunningServer, drive_completions, log

# The StreamsResult fields a round's figure is the median of (the others: summed counts).
MEDIAN_FIELDS = ("tok_s", "ttft_p50", "itl_p50", "wall_s")


class NamedWorkload(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def streams(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...


def median_result(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One workload's figures on one server over its rounds (StreamsResult as dicts): the
    median of each rate and latency, the requests and tokens of all rounds, the rounds' tok/s."""
    merged: dict[str, Any] = {f: statistics.median(r[f] for r in rounds) for f in MEDIAN_FIELDS}
    merged["requests"] = sum(r["requests"] for r in rounds)
    merged["tokens"] = sum(r["tokens"] for r in rounds)
    merged["rounds_tok_s"] = [r["tok_s"] for r in rounds]
    merged["rounds_itl_p50"] = [r["itl_p50"] for r in rounds]
    return merged


def run_interleaved(
    servers: Sequence[tuple[str, HttpServer]],
    workloads: Sequence[NamedWorkload],
    prompts: Callable[[NamedWorkload, int], list[str]],
    rounds: int,
    ready_timeout: float,
) -> list[dict[str, Any]]:
    """bench.peers' records ("key": the server's name in the run) for `servers` started
    together; prompts(workload, round) gives each round's prompts, the same for every server."""
    running = [(key, s, RunningServer(s, s.log_path)) for key, s in servers]
    records: dict[str, dict[str, Any]] = {}
    models: dict[str, str] = {}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for key, server, proc in running:
            records[key] = {"key": key} | server.record()
            records[key]["ready_s"], models[key] = proc.wait_ready(ready_timeout)
            log(f"{server.name} ready after {records[key]['ready_s']:.1f} s")
            warm = prompts(workloads[0], -1)[:2]  # first-call allocations, before any round
            asyncio.run(drive_completions(server.base_url, models[key], warm, len(warm), 16))
        for r in range(rounds):
            for w in workloads:
                round_prompts = prompts(w, r)
                for key, server, _ in running:
                    result = asyncio.run(
                        drive_completions(server.base_url, models[key], round_prompts, w.streams, w.max_tokens)
                    )
                    runs.setdefault((key, w.name), []).append(dataclasses.asdict(result))
                    log(
                        f"round {r + 1}/{rounds} {server.name} | {w.name}: {result.tok_s:.1f} tok/s, "
                        f"ITL p50 {result.itl_p50 * 1e3:.1f} ms"
                    )
    finally:
        for _, _, proc in running:
            proc.stop()
    for (key, name), done in runs.items():
        records[key]["results"][name] = median_result(done)
    for record in records.values():
        record["load_after"] = f"{load_average():.2f}"
    return list(records.values())
