"""Helpers shared by the benchmarks (beside bench/common.py): plots, percentiles,
process memory, worker Info, prompt text, progress bars and timed token streams.
Not a benchmark itself (bench/run_all.py knows it is a helper)."""

from __future__ import annotations

import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.common import RESULTS
from proto import worker_pb2, worker_pb2_grpc
from svc_common import defaults
from svc_common.processes import REPO

DEFAULT_MODEL = REPO / defaults.DEFAULT_MODEL


def require_model(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").exists():
        raise SystemExit(f"{path} missing: run `make model` first")
    return path


# ---- statistics --------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


# ---- plots -------------------------------------------------------------------
def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, name: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


# ---- progress ----------------------------------------------------------------
def progress(total: int, desc: str):
    """A tqdm bar on stderr (long runs show they are alive)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True, leave=False)


# ---- process memory (Linux /proc) ---------------------------------------------
def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size (VmHWM) since it started."""
    return _status_kb(pid, "VmHWM") / 1024


def rss_mb(pid: int) -> float:
    return _status_kb(pid, "VmRSS") / 1024


# ---- the worker's Info ---------------------------------------------------------
def worker_info(address: str) -> worker_pb2.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=30)


# ---- prompts -------------------------------------------------------------------
def text_words() -> list[str]:
    """English-ish technical prose that ships with CPython (the Language Reference)."""
    from pydoc_data.topics import topics

    return " ".join(topics[k] for k in sorted(topics)).split()


def word_prompts(n: int, min_words: int = 20, max_words: int = 120, seed: int = 0) -> list[str]:
    """n prompts of min_words..max_words words (uniform), cut from the text at random places."""
    words = text_words()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_words, max_words)
        start = rng.randrange(0, len(words) - length)
        prompts.append(" ".join(words[start : start + length]))
    return prompts


def random_token_ids(n: int, rng: random.Random, low: int = 100, high: int = 40000) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


# ---- timed token streams ---------------------------------------------------------
@dataclass
class TimedStream:
    """One Generate stream read on its own thread: arrival time of every token."""

    client: object  # SchedulerClient
    token_ids: list[int]
    max_tokens: int
    times: list[float] = field(default_factory=list)  # perf_counter per received token
    first_token_at: float | None = None
    finished_at: float | None = None
    started_at: float = 0.0
    error: str | None = None
    _call: object = None
    _thread: threading.Thread | None = None
    _cancelled: bool = False

    def start(self) -> TimedStream:
        self.started_at = time.perf_counter()
        self._call = self.client.stream(
            prompt_token_ids=self.token_ids, max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True, timeout=3600
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        try:
            for reply in self._call:
                now = time.perf_counter()
                for _ in reply.token_ids:
                    self.times.append(now)
                if reply.token_ids and self.first_token_at is None:
                    self.first_token_at = now
                if reply.finished:
                    break
        except grpc.RpcError as err:
            if not self._cancelled:
                self.error = f"{err.code().name}: {err.details()}"
        self.finished_at = time.perf_counter()

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def join(self, timeout: float | None = None) -> None:
        if self._thread:
            self._thread.join(timeout)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def gaps_ms(self, start: float, end: float) -> list[float]:
        """Inter-token gaps whose later token arrived in (start, end]."""
        return [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:]) if start < b <= end]


def wait_until(
    predicate, timeout_s: float, interval_s: float = 0.01, what: str = "condition", streams: list[TimedStream] = ()
) -> None:
    """Poll predicate(); raise if it is still false after timeout_s, or at once if
    one of `streams` failed."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if failed := next((s for s in streams if s.error), None):
            raise RuntimeError(f"a stream failed while waiting for {what}: {failed.error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
