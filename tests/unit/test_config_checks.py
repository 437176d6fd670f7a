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


def _scheduler(argv: list[str]) -> SchedulerConfig:
    from svc_common.cli import build_parser

    args = vars(build_parser(SchedulerConfig, "PAGEDSERVE_SCHEDULER", "").parse_args(argv))
    return SchedulerConfig(**{k: v for k, v in args.items() if v is not None})


def test_speculative_decoding_takes_vllms_flags_and_its_json_form():
    """`--speculative-method ngram` with the number flags, or vLLM's `--speculative-config`
    JSON: the same drafts' options either way; neither: off."""
    from scheduler_svc.speculative.ngram import NgramConfig

    assert _scheduler([]).speculative() is None
    flags = _scheduler(
        ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "1", "--ngram-max", "5"]
    )
    flags.validate()
    want = NgramConfig(num_speculative_tokens=3, ngram_min=1, ngram_max=5)
    assert flags.speculative() == want
    assert flags.planner_config(64, 16, 8).speculative == want
    json_form = _scheduler(
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5}',
        ]
    )
    json_form.validate()
    assert json_form.speculative() == want
    # Keys left out take the flags' defaults; disable_by_batch_size is vLLM's key too.
    assert _scheduler(["--speculative-config", '{"method": "ngram", "disable_by_batch_size": 6}']).speculative() == (
        NgramConfig(disable_by_batch_size=6)
    )


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--speculative-method", "eagle"], "--speculative-method: unknown method 'eagle'"),
        (["--speculative-config", '{"method": "medusa"}'], "unknown method 'medusa'"),
        (["--speculative-config", '{"method": "ngram", "model": "x"}'], "unknown key(s) model"),
        (["--speculative-config", '{"num_speculative_tokens": 3}'], "method must be given"),
        (["--speculative-config", '{"method": "ngram", "prompt_lookup_max": "4"}'], "prompt_lookup_max must be"),
        (["--speculative-config", "ngram"], "--speculative-config: not JSON"),
        (["--speculative-config", '["ngram"]'], "--speculative-config: must be a JSON object"),
        # The ranges are NgramConfig's, named by the JSON's key when it came from the JSON.
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "num_speculative_tokens must"),
        (["--speculative-method", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-max must be >="),
        (
            ["--speculative-config", '{"method": "ngram"}', "--num-speculative-tokens", "3"],
            "not with --num-speculative-tokens",
        ),
    ],
)
def test_an_unknown_speculative_method_or_key_is_refused_at_start_naming_it(argv, named):
    with pytest.raises(ValueError) as err:
        _scheduler(argv).validate()
    assert named in str(err.value)
