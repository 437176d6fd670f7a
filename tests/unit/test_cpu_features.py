"""--dtype auto and the worker's thread count from the CPU (svc_common/cpu_features.py),
on the three CPUs these machines come as, whatever CPU runs the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from svc_common import cpu_features
from svc_common.cpu_features import auto_dtype, parse_cpuinfo, resolve_dtype, thread_plan

COMMON = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma"
CPUINFO = {
    "epyc-avx512-bf16": ("AMD EPYC", COMMON + " avx2 avx512f avx512dq avx512bw avx512_vnni avx512_bf16"),
    "epyc-avx2": ("AMD EPYC 7B12", COMMON + " avx2"),
    "xeon-amx": (
        "Intel(R) Xeon(R) Platinum 8481C",
        COMMON + " avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8",
    ),
    "xeon-amx-without-avx512-bf16-flag": ("Intel(R) Xeon(R) 6", COMMON + " avx2 avx512f amx_bf16 amx_tile"),
}


def cpuinfo_text(model: str, flags: str, processors: int = 2) -> str:
    block = "processor\t: {n}\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
    return "".join(block.format(n=n, model=model, flags=flags) for n in range(processors))


@pytest.mark.parametrize(
    "cpu,expected",
    [
        ("epyc-avx512-bf16", "bfloat16"),
        ("epyc-avx2", "float32"),
        ("xeon-amx", "bfloat16"),
        ("xeon-amx-without-avx512-bf16-flag", "bfloat16"),
    ],
)
def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_bf16(cpu, expected):
    model, flags = CPUINFO[cpu]
    features = parse_cpuinfo(cpuinfo_text(model, flags), cores=2)
    assert features.model == model and features.cores == 2
    assert auto_dtype(features) == expected
    assert resolve_dtype("auto", "cpu", features) == expected


def test_flags_are_whole_words():
    # "avx512_bf16" inside another flag's name must not count.
    features = parse_cpuinfo(cpuinfo_text("X", COMMON + " avx512_bf16_emulated xamx_bf16"), cores=4)
    assert not features.native_bf16 and auto_dtype(features) == "float32"


def test_explicit_dtype_and_cuda():
    features = parse_cpuinfo(cpuinfo_text(*CPUINFO["epyc-avx2"]), cores=2)
    assert resolve_dtype("bfloat16", "cpu", features) == "bfloat16"  # asked for: kept, even if slow here
    assert resolve_dtype("float16", "cpu", features) == "float16"
    assert resolve_dtype("auto", "cuda", features) == "bfloat16"


def test_unreadable_cpuinfo_gives_fp32(tmp_path: Path):
    features = cpu_features.read_cpu_features(tmp_path / "missing")
    assert features.flags == frozenset() and features.model == "unknown CPU"
    assert auto_dtype(features) == "float32" and features.cores >= 1


def test_this_machine_is_described():
    features = cpu_features.read_cpu_features()
    assert features.cores >= 1
    assert features.describe().startswith(features.model)
    if "avx512_bf16" in Path("/proc/cpuinfo").read_text().split():
        assert auto_dtype(features) == "bfloat16"


@pytest.mark.parametrize(
    "cores,beside,threads", [(1, True, 1), (2, True, 1), (3, True, 2), (4, True, 3), (16, True, 15), (2, False, 2)]
)
def test_thread_plan(cores, beside, threads):
    plan = thread_plan(cores, services_beside=beside)
    assert plan.worker_threads == threads and plan.reason


@pytest.mark.parametrize(
    "cores,beside,small,busy", [(1, True, 1, 1), (2, True, 1, 2), (4, True, 3, 4), (2, False, 2, 2)]
)
def test_a_step_of_busy_size_takes_every_core(cores, beside, small, busy):
    plan = thread_plan(cores, services_beside=beside)
    assert plan.threads_for(1) == plan.threads_for(cpu_features.BUSY_STEP_TOKENS - 1) == small
    assert plan.threads_for(cpu_features.BUSY_STEP_TOKENS) == plan.threads_for(4096) == busy


def test_thread_plan_refuses_no_cores():
    with pytest.raises(ValueError, match="cores"):
        thread_plan(0)
