"""The scheduler's LoRA registry and each worker's adapter slots, without torch: a PEFT
adapter directory is read and checked (what we cannot honour refused by field), its
bytes kept for --max-cpu-loras adapters and read again (unchanged) for the others; the
slots are an LRU that never evicts an adapter a running request uses."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.lora.errors import LoraAdapterExists, LoraAdapterNotFound, LoraRejected
from scheduler_svc.lora.registry import LoraRegistry
from scheduler_svc.lora.slots import AdapterSlots, Placement
from scheduler_svc.request import LoraRef
from tests.helpers.lora_dirs import adapter_dir


def test_register_resolve_and_unregister(tmp_path):
    registry = LoraRegistry(max_lora_rank=8, max_cpu_loras=1, reserved_names=frozenset({"base"}))
    a = registry.register("sql", str(adapter_dir(tmp_path, "a", rank=4)))
    assert (a.rank, a.target_modules) == (4, ("q_proj",))
    assert registry.resolve("sql") == a.ref == LoraRef("sql", a.digest)
    b = registry.register("chat", str(adapter_dir(tmp_path, "b", rank=8, seed=1)))
    assert a.digest != b.digest  # other weights, another identity
    with pytest.raises(LoraAdapterExists, match="lora_name: an adapter 'sql' is loaded already"):
        registry.register("sql", str(tmp_path / "b"))
    with pytest.raises(LoraRejected, match="lora_adapter: no adapter 'nope' \\(loaded: chat, sql\\)"):
        registry.resolve("nope")
    with pytest.raises(LoraRejected, match="lora_name: 'base' is the base model's name"):
        registry.register("base", str(tmp_path / "a"))
    with pytest.raises(LoraRejected, match="lora_name: 'a b' must be"):
        registry.register("a b", str(tmp_path / "a"))
    assert registry.unregister("sql") == a
    with pytest.raises(LoraAdapterNotFound, match="no adapter 'sql'"):
        registry.unregister("sql")
    with pytest.raises(LoraRejected, match="lora_adapter: adapter 'sql' was unloaded"):
        registry.files(a.ref)
    # The same name again, other weights: the old requests' ref is not current.
    c = registry.register("sql", str(tmp_path / "b"))
    assert c.ref != a.ref and not registry.current(a.ref) and registry.current(c.ref)


def test_bytes_beyond_max_cpu_loras_are_read_again_and_must_not_have_changed(tmp_path):
    registry = LoraRegistry(max_lora_rank=8, max_cpu_loras=1)
    a = registry.register("a", str(adapter_dir(tmp_path, "a")))
    b = registry.register("b", str(adapter_dir(tmp_path, "b", seed=1)))
    assert list(registry._bytes) == [b.ref]  # one kept: the most recent
    files = registry.files(a.ref)  # read again from its directory
    assert sorted(files.files) == ["adapter_config.json", "adapter_model.safetensors"]
    assert files.digest == a.digest and list(registry._bytes) == [a.ref]
    adapter_dir(tmp_path, "b", seed=7)  # b's weights change on disk
    with pytest.raises(LoraRejected, match="lora_path: .* changed since adapter 'b' was loaded"):
        registry.files(b.ref)


@pytest.mark.parametrize(
    ("config", "rank", "message"),
    [
        ({"use_dora": True}, 4, "use_dora: DoRA adapters are not served"),
        ({"bias": "lora_only"}, 4, "bias: only bias 'none' is served"),
        ({"modules_to_save": ["lm_head"]}, 4, "modules_to_save: fully trained modules are not served"),
        ({"peft_type": "IA3"}, 4, "peft_type: only LORA adapters are served"),
        ({}, 16, "r: rank 16 is more than --max-lora-rank 8"),
        ({"rank_pattern": {"q_proj": 2}}, 4, "rank_pattern: per-module ranks are not served"),
        ({"fan_in_fan_out": True}, 4, "fan_in_fan_out: transposed (Conv1D) weights are not served"),
        ({"r": 4}, 12, "r: rank 12 is more than --max-lora-rank 8"),  # the tensors say more than r
        ({"r": 0}, 4, "r: must be an integer >= 1"),
        ({"target_modules": []}, 4, "target_modules: must name the modules"),
    ],
)
def test_adapters_we_cannot_honour_are_refused_by_field(tmp_path, config, rank, message):
    path = adapter_dir(tmp_path, "x", rank=rank, **config)
    with pytest.raises(LoraRejected) as info:
        LoraRegistry(max_lora_rank=8, max_cpu_loras=1).register("x", str(path))
    assert message in str(info.value)


def test_missing_or_unreadable_files_are_refused_by_name(tmp_path):
    registry = LoraRegistry(max_lora_rank=8, max_cpu_loras=1)
    with pytest.raises(LoraRejected, match="lora_path: .* is not a directory"):
        registry.register("x", str(tmp_path / "missing"))
    path = adapter_dir(tmp_path, "bin")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(LoraRejected, match="adapter_model.bin: pickled weights are not read"):
        registry.register("x", str(path))
    path = adapter_dir(tmp_path, "garbage")
    (path / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(LoraRejected, match="adapter_model.safetensors: is not a safetensors file"):
        registry.register("x", str(path))
    path = adapter_dir(tmp_path, "badjson")
    (path / "adapter_config.json").write_text("{")
    with pytest.raises(LoraRejected, match="adapter_config.json: is not JSON"):
        registry.register("x", str(path))
    (path / "adapter_config.json").write_text(json.dumps([1]))
    with pytest.raises(LoraRejected, match="adapter_config.json: must be a JSON object"):
        registry.register("x", str(path))


def test_slots_are_an_lru_that_spares_adapters_in_use_and_closes_one_when_all_are():
    a, b, c = (LoraRef(n, n) for n in "abc")
    slots = AdapterSlots(2)
    assert slots.admits(None) and not slots.admits(a) and slots.slot(None) == 0
    slots.loaded(a, slots.place(running=set()) or Placement(0, None))
    slots.loaded(b, slots.place(running=set()) or Placement(0, None))
    assert (slots.slot(a), slots.slot(b)) == (1, 2) and slots.resident == [a, b]
    slots.touch(a)  # a used after b: b is the least recently used
    assert slots.place(running={a}) == Placement(2, b)
    assert slots.place(running={b}) == Placement(1, a)
    # Just loaded for a waiting request: not evicted before it runs, and nothing closes.
    assert slots.place(running=set(), waiting={a, b}) is None and slots.closing is None
    # Every slot in use: nothing to place, and the least recently used running adapter (b) closes.
    assert slots.place(running={a, b}) is None
    assert slots.closing == b and not slots.admits(b) and slots.admits(a)
    # Its running requests ended; those waiting for it wait for it to come back.
    placement = slots.place(running={a}, waiting={b})
    assert placement == Placement(2, b)
    slots.loaded(c, placement)
    assert slots.resident == [a, c] and slots.closing is None and (slots.loads, slots.evictions) == (3, 1)
    assert slots.place(running={a, c}) is None and slots.closing == a
    slots.reopen()  # nobody waits any more
    assert slots.admits(a)
    slots.clear()  # the worker restarted
    assert slots.resident == [] and not slots.admits(a)
