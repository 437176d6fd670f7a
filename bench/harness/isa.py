"""Holding the servers of a run to an older instruction set than this CPU's (bench.peers
--isa): issue 38's targets hold "on AVX2-only and on AVX-512 CPUs alike", and the CPU a
session gets is whatever the pool lends. `avx2` runs every server as it would run on an
AVX2-only CPU: pagedserve's C++ kernels built for Haswell (AVX2, FMA, F16C; no AVX-512,
no VNNI, no BF16), torch's own kernels (ATen's dispatch, oneDNN, MKL) held to AVX2, and
llama.cpp built without GGML_NATIVE for AVX2 (llama_cpp.LLAMA_ISA_ARGS).

--dtype auto still reads this CPU's flags (bf16 where it has AVX-512 BF16): a held run
names its dtypes (bench.peers' GGUF run compares with pagedserve-fp32, AVX2's auto).

What this does not reproduce: the AVX2-only CPU's memory bandwidth, caches and clock. A
result is a measurement of the AVX2 code paths side by side on this CPU, not of that CPU.
"""

from __future__ import annotations

_PAGEDSERVE_ENV: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {
        "PAGEDSERVE_CPU_MARCH": "haswell",
        "ATEN_CPU_CAPABILITY": "avx2",
        "DNNL_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}

ISAS = tuple(_PAGEDSERVE_ENV)


def pagedserve_env(isa: str) -> dict[str, str]:
    """The environment that holds a pagedserve process (and its kernel build) to `isa`."""
    return dict(_PAGEDSERVE_ENV[isa])


def describe(isa: str) -> str:
    """The report's line on what the servers were held to ("" for this CPU's own)."""
    if isa == "native":
        return ""
    held = " ".join(f"{k}={v}" for k, v in _PAGEDSERVE_ENV[isa].items())
    return (
        f"instruction sets held to {isa.upper()} on this CPU: pagedserve with {held}; llama.cpp built "
        f"for {isa.upper()} only. Bandwidth, caches and clock are this CPU's, not an {isa.upper()}-only one's."
    )
