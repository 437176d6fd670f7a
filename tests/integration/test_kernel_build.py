"""The shared kernel cache (kernels/build_cache.py) on a busy machine: processes
that build one library at the same moment get one build and say who they wait
for; a builder SIGKILLed mid-compile leaves no process and no lock that delays
the next; a second checkout loads the first one's build. Real compiles, of a
source small enough to take seconds (the product kernels take minutes)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kernels import build_cache, cpu_build
from tools.processes import REPO

TINY = 'extern "C" int pagedserve_test_answer() { return 42; }\n'
# A compiler that stalls its compile jobs while PAGEDSERVE_TEST_STALL names a sleep (the
# stand-in for a long cc1plus), else the real one; the key sees the same compiler either way.
STALLING_CXX = """#!/bin/sh
case " $* " in *" -c "*) if [ -n "$PAGEDSERVE_TEST_STALL" ]; then sleep "$PAGEDSERVE_TEST_STALL"; fi;; esac
exec c++ "$@"
"""
BUILD = """
import ctypes, sys
from pathlib import Path
from kernels.build_cache import Library
path = Library("pagedserve_test", (Path(sys.argv[1]),)).build()
print("ANSWER", ctypes.CDLL(str(path)).pagedserve_test_answer(), path, flush=True)
"""

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def _env(cache: Path, **more: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PAGEDSERVE_KERNEL_CACHE": str(cache), **more}


def _builder(source: Path, cache: Path, log: Path, **env: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", BUILD, str(source)], env=_env(cache, **env), stdout=out, stderr=subprocess.STDOUT
        )


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.1)


def _processes_naming(text: str) -> list[str]:
    """The command lines of live processes that contain `text`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in argv and str(os.getpid()) != cmdline.parent.name:
            found.append(argv)
    return found


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> tuple[Path, Path, build_cache.Library]:
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY + f"// {uuid.uuid4()}: a key of its own\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(cache))
    return source, cache, build_cache.Library("pagedserve_test", (source,))


def test_processes_building_at_once_share_one_build_and_say_whom_they_wait_for(tiny, tmp_path):
    source, cache, library = tiny
    cache.mkdir()
    lock = library.path().with_suffix(".lock")
    logs = [tmp_path / f"builder-{i}.log" for i in range(2)]
    with build_cache._exclusive(lock):  # a build held by this process: both start behind it
        builders = [_builder(source, cache, log) for log in logs]
        for log in logs:
            _wait_for(lambda log=log: b"waiting for a kernel build" in log.read_bytes(), 60, f"waiting line in {log}")
    outputs = []
    for builder, log in zip(builders, logs):
        assert builder.wait(180) == 0, log.read_text()
        outputs.append(log.read_text())
    for out in outputs:
        assert f"holder_pid={os.getpid()}" in out
        assert re.search(rf"ANSWER 42 {re.escape(str(library.path()))}$", out, re.M), out
    assert sum(out.count("kernel library built ") for out in outputs) == 1, outputs
    assert any("another process built the kernel library" in out for out in outputs), outputs
    assert sorted(p.name for p in cache.iterdir()) == sorted([library.path().name, lock.name])  # no work folder left


def test_a_builder_killed_mid_compile_leaves_nothing_that_delays_the_next(tiny, tmp_path, monkeypatch):
    source, cache, library = tiny
    cxx = tmp_path / "c++"
    cxx.write_text(STALLING_CXX)
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))  # part of the key: the library's path here is the builders'
    stall = f"{600 + uuid.uuid4().int % 1000 / 1000:.3f}"
    first = _builder(source, cache, tmp_path / "first.log", CXX=str(cxx), PAGEDSERVE_TEST_STALL=stall)
    _wait_for(lambda: _processes_naming(f"sleep {stall}"), 120, "compile job")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    # Its compile child sees it gone and stops its group: ninja, the compiler, the compile job.
    _wait_for(lambda: not _processes_naming(f"sleep {stall}") and not _processes_naming(str(cache)), 15, "clean-up")
    assert list(cache.glob(".build-*")), "the killed build's work folder (the next builder removes it)"
    start = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-c", BUILD, str(source)], env=_env(cache, CXX=str(cxx)), capture_output=True, text=True
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "waiting for a kernel build" not in second.stdout and "ANSWER 42" in second.stdout
    assert not list(cache.glob(".build-*"))
    assert time.monotonic() - start < 170  # a fresh compile, never the old 900 s lock
    assert ctypes.CDLL(str(library.path())).pagedserve_test_answer() == 42


def test_a_second_checkout_loads_the_first_ones_build_without_compiling(tmp_path):
    if not cpu_build.load():
        pytest.skip("the C++ CPU kernels cannot be built here")
    built = cpu_build.LIBRARY.path()
    mtime = built.stat().st_mtime_ns
    other = tmp_path / "checkout"
    shutil.copytree(REPO / "kernels", other / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    probe = (
        "import torch\nfrom kernels import cpu_build\nassert cpu_build.load()\n"
        "print('LOADED', *torch.ops.loaded_libraries, 'FROM', cpu_build.__file__)\n"
    )
    env = {**_env(cpu_build.LIBRARY.path().parent), "PYTHONPATH": str(other)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=other, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"LOADED {built} FROM {other / 'kernels' / 'cpu_build.py'}" in done.stdout
    assert "compiling" not in done.stdout + done.stderr
    assert built.stat().st_mtime_ns == mtime


def test_a_failed_build_names_the_compilers_first_error(tmp_path):
    """The error that stopped the build leads the message, however much output came
    after it (later errors and warnings, the build child's traceback: a 40-line tail
    once showed only `raise CalledProcessError`)."""
    source = tmp_path / "broken.cpp"
    filler = "".join(f"#warning pagedserve_filler_{i}\n" for i in range(60))
    source.write_text(f"#error pagedserve_first_error\n{filler}{TINY}")
    probe = (
        "import sys\nfrom pathlib import Path\nfrom kernels.build_cache import BuildError, Library\n"
        "try:\n    Library('pagedserve_broken', (Path(sys.argv[1]),)).build()\n"
        "except BuildError as exc:\n    print('MESSAGE', str(exc).splitlines()[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(source)], env=_env(tmp_path / "cache"), capture_output=True, text=True
    )
    first = next(line for line in done.stdout.splitlines() if line.startswith("MESSAGE"))
    assert "error: #error pagedserve_first_error" in first, done.stdout + done.stderr


def test_a_build_for_another_march_has_a_key_of_its_own():
    """PAGEDSERVE_CPU_MARCH (an AVX2 fleet, bench.peers --isa avx2) builds beside the
    native library, never over it nor loaded in its place."""
    probe = "from kernels import cpu_build\nprint(cpu_build.LIBRARY.key(), *cpu_build.LIBRARY.cflags)"
    keys = {}
    for march in ("native", "haswell"):
        env = {**os.environ, "PAGEDSERVE_CPU_MARCH": march, "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        key, *flags = done.stdout.split()
        assert f"-march={march}" in flags
        keys[march] = key
    assert keys["native"] != keys["haswell"]
    assert cpu_build.LIBRARY.key() == keys[os.environ.get("PAGEDSERVE_CPU_MARCH", "native")]
