"""Multi-LoRA on the worker (issue 40): a mixed batch of the base model and several
PEFT adapters (different ranks, scalings, target modules) in one forward gives,
row for row, the greedy tokens of transformers + PEFT with that adapter merged
(fp32); slots load, reload and unload between steps; adapters we cannot serve
exactly are refused naming the field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import cpu_ops
from tests.helpers.checkpoints import tiny_adapter, tiny_checkpoint
from tools.tiny_adapters import merged_model
from worker_svc.config import WorkerConfig
from worker_svc.lora import AdapterRefused
from worker_svc.step.builder import StepBuilder
from worker_svc.step.errors import InvalidStep
from worker_svc.worker import Worker

# slot -> adapter (tools/tiny_adapters.py: ADAPTERS); slot 0 is the base model
ADAPTERS = {1: "r4_qv", 2: "r8_all_rslora", 3: "r2_mlp", 4: "r16_ko_down"}
BLOCK = 16
NEW_TOKENS = 8


def lora_worker(family: str, backend: str = "auto", graph_backend: object = None, **overrides: object) -> Worker:
    config = dict(
        model=str(tiny_checkpoint(family)),
        dtype="float32",
        num_blocks=64,
        attention_backend=backend,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
    )
    return Worker(WorkerConfig(**(config | overrides)), graph_backend=graph_backend)  # type: ignore[arg-type]


def expected_tokens(family: str, slot: int, prompt: list[int]) -> list[int]:
    base_dir = tiny_checkpoint(family)
    if slot == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    else:
        model = merged_model(base_dir, tiny_adapter(family, ADAPTERS[slot]))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def generate(
    worker: Worker, rows: dict[int, tuple[int, list[int]]], chunked: int | None = None
) -> dict[int, list[int]]:
    """Greedy tokens of every row (seq_id -> (slot, prompt)), all rows in every step;
    `chunked`: that row's prompt goes in two chunks over two steps."""
    tables = {seq: [seq * 4 + b for b in range(4)] for seq in rows}
    step_id = 0

    def step(chunks: dict[int, tuple[list[int], int]]) -> dict[int, int]:
        nonlocal step_id
        step_id += 1
        builder = StepBuilder(BLOCK)
        for seq, (tokens, start) in chunks.items():
            table = tables[seq][: -(-(start + len(tokens)) // BLOCK)]
            builder.add(seq, tokens, start, table, sample=True, lora_slot=rows[seq][0])
        out = worker.step(builder.build(step_id))
        return dict(zip(out.samples.seq_ids.tolist(), out.samples.token_ids.tolist()))

    first = {seq: (prompt, 0) for seq, (_, prompt) in rows.items()}
    if chunked is not None:
        prompt = rows[chunked][1]
        step({chunked: (prompt[:5], 0)})
        first[chunked] = (prompt[5:], 5)
    last = step(first)
    tokens = {seq: [last[seq]] for seq in rows}
    for i in range(NEW_TOKENS - 1):
        last = step({seq: ([tokens[seq][-1]], len(rows[seq][1]) + i) for seq in rows})
        for seq in rows:
            tokens[seq].append(last[seq])
    return tokens


def load_all(worker: Worker, family: str) -> None:
    for slot, name in ADAPTERS.items():
        worker.load_adapter(slot, name, tiny_adapter(family, name))


@pytest.mark.parametrize(
    "family,backend",
    [
        ("llama", "torch"),
        pytest.param("llama", "auto", marks=pytest.mark.skipif(not cpu_ops.available(), reason="no C++ kernels here")),
        ("qwen3", "auto"),
    ],
)
def test_mixed_batch_matches_peft_merged_adapters(family, backend):
    worker = lora_worker(family, backend)
    load_all(worker, family)
    g = torch.Generator().manual_seed(7)
    rows = {
        seq: (slot, torch.randint(3, worker.info.vocab_size, (9 + 3 * seq,), generator=g).tolist())
        for seq, slot in enumerate([0, 1, 2, 3, 4, 2])
    }
    got = generate(worker, rows, chunked=2)
    want = {seq: expected_tokens(family, slot, prompt) for seq, (slot, prompt) in rows.items()}
    assert got == want
    # the adapters really change the tokens: no two slots agree on the same prompt
    same_prompt = {slot: (slot, rows[0][1]) for slot in range(5)}
    outs = generate(worker, same_prompt)
    assert len({tuple(t) for t in outs.values()}) == 5, outs


def test_reload_replaces_and_unload_refuses_the_slot():
    worker = lora_worker("llama", "torch")
    load_all(worker, "llama")
    prompt = list(range(20, 33))
    worker.load_adapter(1, "r2_mlp", tiny_adapter("llama", "r2_mlp"))  # slot 1 now holds another adapter
    assert generate(worker, {0: (1, prompt)})[0] == expected_tokens("llama", 3, prompt)
    worker.unload_adapter(1)
    with pytest.raises(InvalidStep, match=r"seqs.lora_slots\[row 0\]: slot 1: no adapter is loaded there"):
        generate(worker, {0: (1, prompt)})
    worker.load_adapter(1, "r4_qv", tiny_adapter("llama", "r4_qv"))  # back, as an evicted adapter would be
    assert generate(worker, {0: (1, prompt)})[0] == expected_tokens("llama", 1, prompt)


def test_a_worker_without_lora_refuses_slots_and_adapters():
    worker = Worker(WorkerConfig(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=16))
    assert (worker.info.max_loras, worker.info.max_lora_rank) == (0, 0)
    with pytest.raises(InvalidStep, match=r"seqs.lora_slots\[row 0\]: slot 1: this worker runs without --enable"):
        generate(worker, {0: (1, [5, 6, 7])})
    with pytest.raises(AdapterRefused, match="without --enable-lora"):
        worker.load_adapter(1, "x", tiny_adapter("llama", "r4_qv"))


def _edited(tmp_path: Path, source: Path, config: dict[str, object] | None = None, tensors=None) -> Path:
    out = tmp_path / "adapter"
    shutil.copytree(source, out)
    if config is not None:
        path = out / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    if tensors is not None:
        save_file(tensors(load_file(out / "adapter_model.safetensors")), out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize(
    "config,field",
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 32}, "r"),
    ],
)
def test_adapters_we_cannot_serve_exactly_are_refused_by_field(tmp_path, config, field):
    worker = lora_worker("llama", "torch")
    bad = _edited(tmp_path, tiny_adapter("llama", "r4_qv"), config)
    with pytest.raises(AdapterRefused) as refused:
        worker.load_adapter(1, "bad", bad)
    assert refused.value.field == field


def test_tensors_that_do_not_fit_the_base_are_refused_by_name(tmp_path):
    worker = lora_worker("llama", "torch")
    # qwen3's q_proj is 8 heads x 16 = 128 rows; llama's 4 x 16 = 64
    with pytest.raises(AdapterRefused, match=r"model.layers.0.self_attn.q_proj.lora_B.weight: shape \[128, 4\]"):
        worker.load_adapter(1, "qwen3's", tiny_adapter("qwen3", "r4_qv"))
    extra_layer = _edited(
        tmp_path,
        tiny_adapter("llama", "r4_qv"),
        tensors=lambda t: (
            t | {k.replace("layers.1.", "layers.7."): v.clone() for k, v in t.items() if "layers.1." in k}
        ),
    )
    with pytest.raises(
        AdapterRefused, match=r"layers\.7\.self_attn\.[qv]_proj\.lora_[AB]\.weight: layer 7, but the base model has 2"
    ):
        worker.load_adapter(1, "deep", extra_layer)
    with pytest.raises(AdapterRefused, match="slot: 5: must be 1..4"):
        worker.load_adapter(5, "r4_qv", tiny_adapter("llama", "r4_qv"))
    with pytest.raises(AdapterRefused, match="has no adapter_config.json or adapter_model.safetensors"):
        worker.load_adapter(1, "empty", tmp_path)


class _ReplayRuns:
    """A graph backend whose replay runs the captured forward again over the graphs'
    persistent buffers (what a CUDA graph reads), counting replays."""

    replays = 0

    def capture(self, forward):
        forward()
        return lambda: (setattr(self, "replays", self.replays + 1), forward())[1]


def test_decode_graphs_take_each_steps_slots_as_data():
    """Decode steps through the captured graphs (on CPU: the forward re-run over the
    graphs' buffer) with each row's adapter changing from step to step: the tokens
    and logits of the eager worker, the same graph replayed for every adapter mix."""
    backend = _ReplayRuns()
    graphs = lora_worker("llama", graph_backend=backend, max_num_seqs=8)
    eager = lora_worker("llama")
    for w in (graphs, eager):
        load_all(w, "llama")
    before = backend.replays
    prompts = {seq: list(range(40 + seq, 50 + 2 * seq)) for seq in range(5)}
    for step_id, shift in enumerate((0, 1, 2, 3)):
        outs = []
        for w in (graphs, eager):
            builder = StepBuilder(BLOCK)
            for seq, prompt in prompts.items():
                tokens, start = (prompt, 0) if step_id == 0 else ([7 + step_id], len(prompt) + step_id - 1)
                table = [seq * 4 + b for b in range(4)]
                builder.add(seq, tokens, start, table[: -(-(start + len(tokens)) // BLOCK)], sample=True,
                            return_logits=True, lora_slot=(seq + shift) % 5)  # fmt: skip
            outs.append(w.step(builder.build(step_id + 1)))
        got, want = outs
        assert got.samples.token_ids.tolist() == want.samples.token_ids.tolist()
        for row, logits in want.samples.logits.items():
            torch.testing.assert_close(got.samples.logits[row], logits, atol=1e-5, rtol=1e-5)
    assert backend.replays - before == 3  # the three decode steps, one padded graph (8 rows)
