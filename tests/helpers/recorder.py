"""Greedy streams run in background threads (their tokens as they arrive, how
each ended; or an HTTP event stream's `data:` payloads), and polling for a
condition with a deadline."""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx

from scheduler_svc.client import SchedulerClient
from tools.processes import ServiceProcess


class Recorder(threading.Thread):
    """One greedy stream in the background: its tokens as they arrive, how it ended."""

    def __init__(self, client: SchedulerClient, prompt_ids: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.client, self.prompt_ids, self.max_tokens = client, prompt_ids, max_tokens
        self.tokens: list[int] = []
        self.finish_reason = ""
        self.error: grpc.RpcError | None = None
        self.ended_at = 0.0

    def run(self) -> None:
        try:
            for reply in self.client.stream(
                prompt_token_ids=self.prompt_ids, max_tokens=self.max_tokens, temperature=0.0, timeout=120
            ):
                self.tokens.extend(reply.token_ids)
                if reply.finished:
                    self.finish_reason = reply.finish_reason
        except grpc.RpcError as err:
            self.error = err
        self.ended_at = time.monotonic()


def read_events(url: str, body: dict, events: list[str], timeout_s: float = 60.0) -> threading.Thread:
    """POST `body` (stream: true) to the gateway's /v1/completions at `url` in the background;
    each event's `data:` payload is appended to `events` as it arrives."""

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def join(recorders: list[Recorder], timeout_s: float = 90.0) -> None:
    for r in recorders:
        r.join(timeout_s)
        assert not r.is_alive(), "a stream never ended"


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def finished_records(proc: ServiceProcess) -> dict[str, dict]:
    """request id -> its 'request finished' log record (which names the worker)."""
    records = (json.loads(line) for line in proc.log_path.read_text().splitlines() if line.startswith("{"))
    return {r["request_id"]: r for r in records if r.get("event") == "request finished"}
