"""The C++ kernels built for instruction sets below this CPU's: `haswell` (AVX2 and FMA,
no AVX-512: the AVX2-only EPYCs users serve from) and `x86-64-v2` (no AVX2: older CPUs
and VMs that mask it, where every kernel takes its generic path). Each must build, load
and pass the kernels' own tests, which hold every path to its torch reference. A build
per ISA takes minutes on 2 cores: `make test-slow`.

A pre-AVX2 build once failed to compile (a constant declared in the AVX2 code only) and
the fp32 GGUF path it falls back to summed a last partial group of rows in another order,
and neither was seen: no test built for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tools.processes import REPO

KERNEL_TESTS = [
    "tests/unit/test_quant_int8_cpu.py",
    "tests/unit/test_quant_activations.py",
    "tests/unit/test_quant_linear_cpu.py",
    "tests/unit/test_cpu_ops.py",
    "tests/unit/test_cpu_attention_tiles.py",
    "tests/unit/test_cpu_sampling_op.py",
    "tests/unit/test_work_pool.py",
    "tests/unit/test_wquant_cpu.py",
    "tests/unit/test_moe_kernels.py",
    "tests/unit/test_lora_kernels.py",
    "tests/unit/test_kv_quant.py",
    "tests/unit/test_softcap_attention.py",
    "tests/unit/test_cpu_verify.py",
]
LOADED = (
    "from kernels import cpu_build\n"
    "assert cpu_build.load(), 'the kernels did not load'\n"
    "print(*cpu_build.LIBRARY.cflags)"
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")]


@pytest.mark.parametrize("march", ["haswell", "x86-64-v2"])
def test_kernels_built_for_an_older_isa_pass_their_tests(march, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PAGEDSERVE_CPU_MARCH": march,
        "PAGEDSERVE_KERNEL_CACHE": str(tmp_path / "kernels"),
    }
    built = subprocess.run([sys.executable, "-c", LOADED], env=env, cwd=REPO, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert f"-march={march}" in built.stdout
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *KERNEL_TESTS],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
