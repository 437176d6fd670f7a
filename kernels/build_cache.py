"""Build C++ sources into a torch op library once per machine, in a cache any number
of checkouts and processes share safely (docs/design.md, section 8).

A library is one file, `<cache>/<name>_<key>.so`. The key hashes everything that
changes the binary: the sources' and headers' content (not their paths, so a second
checkout finds the first one's build), the flags, the compiler's version, torch's
version, the Python ABI and the CPU's model and flags (what -march=native compiles
for). Nothing here imports torch until a library is loaded, so a launcher can ask
`built()` cheaply before it starts any worker.

A build runs in a private temporary folder under the cache, in a child process of
its own (its own process group, ninja and the compiler under it) and the finished
`.so` is renamed into place: a reader sees a whole library or none. A finished one
is loaded directly (torch.ops.load_library), without ninja.

One builder per key at a time: it holds an flock(2) on `<name>_<key>.lock`, which
the kernel drops when the holder dies however it dies (SIGKILL included), so a
killed build delays nothing and no lock ever has to age out. A process that finds
the lock held logs that it waits, with the holder's pid and for how long, and then
loads what the holder built. A build whose parent died (a worker killed at its
start-up timeout) stops its whole process group within a second: no orphan ninja or
cc1plus keeps a core; what such a build left in the cache is removed by the next
builder of that key.

    PAGEDSERVE_KERNEL_CACHE   the cache folder (default ~/.cache/pagedserve/kernels)
"""

from __future__ import annotations

import collections
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("kernels.build")

# Bumped when the way a library is built changes (its files, its defines).
FORMAT = "2"
HEARTBEAT_S = 15.0  # a line while a compile or a wait goes on, so no minute is silent
_UNIT = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")  # ninja -v: one line per finished compile unit or link


class BuildError(RuntimeError):
    """The compile failed (its last output lines are in the message) or was stopped."""


def cache_root() -> Path:
    default = Path.home() / ".cache" / "pagedserve" / "kernels"
    return Path(os.environ.get("PAGEDSERVE_KERNEL_CACHE", default))


def compiler() -> str:
    """What torch.utils.cpp_extension compiles with (CXX may be a wrapper and its compiler: `ccache g++`)."""
    return os.environ.get("CXX", "c++")


@functools.cache
def _compiler_identity(cxx: str) -> str:
    command = shlex.split(cxx)
    path = shutil.which(command[0]) if command else None
    if path is None:
        return f"{cxx}: not found"
    try:
        done = subprocess.run([path, *command[1:], "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{path}: {exc}"
    return "\n".join([shlex.join([os.path.realpath(path), *command[1:]]), done.stdout])


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.cache
def _cpu_identity() -> str:
    """The CPU's model and flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":", 1)[0].strip() in wanted}))


@dataclass(frozen=True)
class Library:
    """C++ sources compiled and linked into one shared library of torch ops."""

    name: str  # the file name's stem before the key; an identifier (TORCH_EXTENSION_NAME)
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()  # what the sources include: their content is in the key
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()

    def key(self) -> str:
        digest = hashlib.sha256()
        parts = [
            FORMAT,
            *(p.read_bytes().decode(errors="replace") for p in (*self.sources, *self.headers)),
            " ".join(self.cflags),
            " ".join(self.ldflags),
            _compiler_identity(compiler()),
            _torch_version(),
            sys.version,
            str(sysconfig.get_config_var("SOABI")),
            _cpu_identity(),
        ]
        for part in parts:
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()[:16]

    def stem(self) -> str:
        return f"{self.name}_{self.key()}"

    def path(self) -> Path:
        return cache_root() / f"{self.stem()}.so"

    def built(self) -> bool:
        return self.path().is_file()

    def build(self) -> Path:
        """The library's path, built now unless it is (or another process is building it: wait)."""
        target = self.path()
        if target.is_file():
            return target
        if _compiler_identity(compiler()).endswith(": not found"):
            raise BuildError(f"no C++ compiler: {compiler()}: not found (install g++, or set CXX)")
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(target.with_suffix(".lock")):
            if target.is_file():  # the holder we waited for built it
                log.info("another process built the kernel library", path=str(target))
                return target
            for leftover in target.parent.glob(f".build-{self.stem()}-*"):  # a killed build's; no one uses it now
                shutil.rmtree(leftover, ignore_errors=True)
            work = Path(tempfile.mkdtemp(prefix=f".build-{self.stem()}-", dir=target.parent))
            try:
                built = self._compile(work)
                os.replace(built, target)  # atomic: readers see all of it or nothing
            finally:
                shutil.rmtree(work, ignore_errors=True)
        return target

    def load(self) -> Path:
        """Build if needed, then load the library into this process (its ops register)."""
        path = self.build()  # first: where it cannot be built, torch need not load
        import torch

        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return path

    def _compile(self, work: Path) -> Path:
        stem = self.stem()
        spec = {
            "name": stem,
            "sources": [str(s) for s in self.sources],
            "cflags": list(self.cflags),
            "ldflags": list(self.ldflags),
            "build_directory": str(work),
        }
        names = [s.name for s in self.sources]
        log.info(
            "compiling a kernel library (once per machine and source; ~1-2 min on 2 cores)",
            library=self.name,
            sources=names,
            cache=str(work.parent),
        )
        start = time.monotonic()
        # Own process group: the child stops ninja and the compiler with it; and we can stop them all.
        proc = subprocess.Popen(
            [sys.executable, "-m", "kernels.build_cache", json.dumps(spec)],
            cwd=Path(__file__).resolve().parent.parent,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            encoding="utf-8",
            errors="replace",  # a compiler's quotes in any locale
            start_new_session=True,
        )
        try:
            tail, first_error = _follow(proc, start)
        except BaseException:  # Ctrl-C, or a signal turned into an exception: stop the compile too
            _stop_group(proc)
            raise
        if proc.returncode != 0:
            _stop_group(proc)  # a child killed outright leaves its compile jobs behind
            what = first_error or (tail[-1] if tail else "")
            raise BuildError(f"{self.name}: the compile exited with {proc.returncode}: {what}\n" + "\n".join(tail))
        built = work / f"{stem}.so"
        if not built.is_file():
            raise BuildError(f"{self.name}: the compile wrote no {built.name}:\n" + "\n".join(tail))
        log.info("kernel library built", library=self.name, seconds=round(time.monotonic() - start, 1))
        return built


def _follow(proc: subprocess.Popen[str], start: float) -> tuple[list[str], str]:
    """Log the child's compile units as they finish and a heartbeat between them, until
    it exits; its last output lines and the first line that said what went wrong (a
    compiler's first error is often far above the tail, behind later errors and the
    child's traceback)."""
    lines: queue.Queue[str | None] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True, name="kernel-build-output").start()
    tail: collections.deque[str] = collections.deque(maxlen=40)
    first_error = ""
    last_said = time.monotonic()
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if proc.poll() is not None:  # the child is gone but something of its group holds the pipe
                break
            if time.monotonic() - last_said >= HEARTBEAT_S:
                log.info("still compiling", seconds=round(time.monotonic() - start))
                last_said = time.monotonic()
            continue
        if line is None:
            break
        tail.append(line)
        if not first_error and _says_what_failed(line):
            first_error = line
        unit = _UNIT.match(line)
        if unit:
            done, total, command = unit.groups()
            source = re.search(r" -c (\S+)", command)
            what = Path(source.group(1)).name if source else "link"
            log.info("compiled", unit=f"{done}/{total}", what=what, seconds=round(time.monotonic() - start))
            last_said = time.monotonic()
    proc.wait()
    return list(tail), first_error


def _says_what_failed(line: str) -> bool:
    """A compiler's error line (`file:line:col: error: ...`, `#error`) or a missing tool."""
    return "error:" in line.lower() or "not found" in line


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the build's process group (ninja passes it on to its compile jobs),
    SIGKILL after a few seconds: nothing of a stopped or failed build keeps running."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an flock on lock_path; while another process holds it, say so every
    HEARTBEAT_S with its pid. The kernel drops the lock with its holder, so the file
    (kept: unlinking a lock file races its next holder) never needs to age out."""
    with open(lock_path, "a+") as f:
        start = time.monotonic()
        last_said = 0.0
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if last_said == 0.0 or time.monotonic() - last_said >= HEARTBEAT_S:
                holder_pid, held_s = _holder(lock_path)
                log.info(
                    "waiting for a kernel build another process runs",
                    holder_pid=holder_pid,
                    held_s=held_s,
                    waited_s=round(time.monotonic() - start),
                    lock=str(lock_path),
                )
                last_said = time.monotonic()
            time.sleep(0.2)
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()} {time.time():.0f}\n")
            f.flush()
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


def _holder(lock_path: Path) -> tuple[int | None, int | None]:
    """(pid, seconds held) of the lock's holder, as it wrote them; None where unknown."""
    try:
        pid, since = lock_path.read_text().split()
        return int(pid), round(time.time() - float(since))
    except (OSError, ValueError):
        return None, None


def _watch_parent(parent: int) -> None:
    """In the compile child: once the process that started it is gone, stop the
    whole group (ninja passes SIGTERM on to its jobs' groups; this process ends too)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os.killpg(0, signal.SIGTERM)


def _compile_child(spec_json: str) -> int:
    """`python -m kernels.build_cache SPEC`: compile SPEC (JSON) into its build directory
    with torch.utils.cpp_extension (ninja -v prints each finished unit)."""
    spec = json.loads(spec_json)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=spec["name"],
        sources=spec["sources"],
        extra_cflags=spec["cflags"],
        extra_ldflags=spec["ldflags"],
        build_directory=spec["build_directory"],
        is_python_module=False,
        verbose=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(_compile_child(sys.argv[1]))
