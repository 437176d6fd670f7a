"""Start-up checks name the flag and the value at fault."""

from __future__ import annotations

import pytest

from scheduler_svc.config import SchedulerConfig
from worker_svc.config import WorkerConfig


@pytest.mark.parametrize(
    "make", [lambda p: WorkerConfig(model=p), lambda p: SchedulerConfig(model=p)], ids=["worker", "scheduler"]
)
def test_a_missing_model_path_names_the_flag_and_the_path(make, tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError) as err:
        make(missing).validate()
    assert "--model" in str(err.value) and missing in str(err.value)


def test_an_empty_directory_is_not_a_model(tmp_path):
    with pytest.raises(ValueError, match="--model"):
        WorkerConfig(model=str(tmp_path)).validate()


def test_the_admin_port_follows_the_serving_port():
    assert SchedulerConfig(port=50051).admin_bind_port == 50052
    assert SchedulerConfig(port=6000).admin_bind_port == 6001
    assert SchedulerConfig(port=0).admin_bind_port == 0  # both OS-picked
    assert SchedulerConfig(port=6000, admin_port=7000).admin_bind_port == 7000
    with pytest.raises(ValueError, match="--admin-port"):
        SchedulerConfig(port=65535).validate()


def test_planner_options_are_checked_once_with_their_flag():
    with pytest.raises(ValueError, match="--chunk-size"):
        SchedulerConfig(chunk_size=0).validate()
    with pytest.raises(ValueError, match="--dynamic-chunk-min"):
        SchedulerConfig(dynamic_chunk_min=4096, dynamic_chunk_max=512).validate()


def test_vllm_flag_spellings_are_aliases():
    """`--kv-cache-dtype` and `--served-model-name`, as vLLM users type them."""
    from gateway_svc.config import GatewayConfig
    from svc_common.cli import build_parser

    worker = build_parser(WorkerConfig, "PAGEDSERVE_WORKER", "").parse_args(["--kv-cache-dtype", "int8"])
    assert worker.kv_dtype == "int8"
    gateway = build_parser(GatewayConfig, "PAGEDSERVE_GATEWAY", "").parse_args(["--served-model-name", "smollm2"])
    assert gateway.model_name == "smollm2"
