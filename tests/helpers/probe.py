"""A probe of a gateway's liveness: back-to-back short streamed completions, from a
process of their own (the test's own work must not delay what they measure), each
event's wait recorded (the first token after sending, or the next token) on
time.monotonic, one clock for every process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

PROBE = """
import json, sys, time, httpx
url, key, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
body = {"prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
with httpx.Client(base_url=url, headers={"Authorization": "Bearer " + key}, timeout=120) as client:
    while True:
        last = time.monotonic()
        with client.stream("POST", "/v1/completions", json=body) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    print(now, now - last, flush=True)
                    last = now
"""
STOP_S = 120.0


class Prober:
    """The longest wait for any event in a window of time."""

    def __init__(self, gateway_url: str, key: str, prompt_ids: list[int]):
        args = [sys.executable, "-c", PROBE, gateway_url, key, json.dumps(prompt_ids)]
        self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        self.waits: list[tuple[float, float]] = []  # (when, how long it had waited)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            fields = line.split()
            if len(fields) == 2:  # a line cut short when the probe is killed is no measurement
                self.waits.append((float(fields[0]), float(fields[1])))

    def longest_wait(self, start: float, end: float) -> float:
        waits = [wait for when, wait in self.waits if start <= when <= end]
        assert waits, "the probe saw no event in the window"
        return max(waits)

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.kill()
        self._proc.wait(STOP_S)
        self._reader.join(STOP_S)
