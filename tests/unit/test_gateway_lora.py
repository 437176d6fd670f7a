"""LoRA through the gateway against the fake scheduler (no model, no torch): the
official openai client selects an adapter by `model` on every generating route
(completions, chat, responses, Anthropic messages), mapped to serving.v1
lora_adapter; an unknown model is still a 404; /v1/models lists the adapters with the
base as parent; /v1/load_lora_adapter and /v1/unload_lora_adapter go to a real
admin.v1 servicer (its admin key checked there, a client key refused)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import openai
import pytest

from proto import serving_pb2
from scheduler_svc.api.admin import start_admin_server
from scheduler_svc.lora.registry import LoraRegistry
from tests.helpers.fake_scheduler import MODEL_NAME, WAIT_S, chat_model_dir, running_gateway
from tests.helpers.lora_dirs import adapter_dir

ADMIN_KEY = "admin-key-0123456789"


@pytest.fixture
def admin(tmp_path):
    """A real admin.v1 server (AdminServicer over a registry holding adapter `sql`) in a thread."""
    registry = LoraRegistry(max_lora_rank=8, max_cpu_loras=1, reserved_names=frozenset({MODEL_NAME}))
    registry.register("sql", str(adapter_dir(tmp_path, "sql")))
    loop = asyncio.new_event_loop()
    engine = SimpleNamespace(lora=registry, kv_events=None, routing="prefix")
    started = threading.Event()
    holder = {}

    async def serve():
        holder["server"], holder["port"] = await start_admin_server(engine, admin_keys=frozenset({ADMIN_KEY}))
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(WAIT_S)
    yield registry, f"127.0.0.1:{holder['port']}"
    asyncio.run_coroutine_threadsafe(holder["server"].stop(None), loop).result(WAIT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(WAIT_S)


@pytest.fixture
def gateway(fake_scheduler, admin, tmp_path):
    registry, admin_address = admin
    fake_scheduler.lora_adapters = lambda: [
        serving_pb2.LoraAdapterInfo(name=a.name, path=a.path, rank=a.rank) for a in registry.adapters.values()
    ]
    (tmp_path / "models").mkdir()
    model_dir = chat_model_dir(tmp_path / "models")
    with running_gateway(
        scheduler=fake_scheduler.address, model_dir=str(model_dir), scheduler_admin=admin_address
    ) as url:
        yield url


def test_model_selects_the_adapter_on_every_generating_route(gateway, fake_scheduler):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="k", max_retries=0)
    completion = client.completions.create(model="sql", prompt="hi", max_tokens=3)
    assert completion.model == "sql" and fake_scheduler.requests[-1].lora_adapter == "sql"
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "sql" and fake_scheduler.requests[-1].lora_adapter == "sql"
    client.responses.create(model="sql", input="hi")
    assert fake_scheduler.requests[-1].lora_adapter == "sql"
    client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3)
    assert fake_scheduler.requests[-1].lora_adapter == ""  # the base
    with httpx.Client(base_url=gateway, timeout=WAIT_S) as http:
        reply = http.post(
            "/v1/messages",
            json={"model": "sql", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert reply.status_code == 200 and fake_scheduler.requests[-1].lora_adapter == "sql"
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=3)
    with pytest.raises(openai.NotFoundError):  # embeddings are the base model's only
        client.embeddings.create(model="sql", input="hi")


def test_models_list_adapters_and_admin_routes_load_and_unload(gateway, fake_scheduler, tmp_path):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="k", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "sql"}
    assert cards["sql"].parent == MODEL_NAME and cards["sql"].root.endswith("/sql")
    assert client.models.retrieve("sql").parent == MODEL_NAME
    path = str(adapter_dir(tmp_path, "chat", seed=3))
    with httpx.Client(base_url=gateway, timeout=WAIT_S) as http:
        body = {"lora_name": "chat", "lora_path": path}
        refused = http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer a-client-key"})
        assert refused.status_code in (401, 403)  # admin.v1 takes admin keys only
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 401  # no key at all
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        loaded = http.post("/v1/load_lora_adapter", json=body, headers=admin)
        assert loaded.status_code == 200 and "'chat' added" in loaded.text
        again = http.post("/v1/load_lora_adapter", json=body, headers=admin)
        assert again.status_code == 400 and "is loaded already" in again.text
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}, headers=admin)
        assert bad.status_code == 400 and "adapter_model.safetensors: missing" in bad.json()["error"]["message"]
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
        assert fake_scheduler.requests[-1].lora_adapter == "chat"
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin)
        assert gone.status_code == 200
        missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin)
        assert missing.status_code == 404
    assert {m.id for m in client.models.list().data} == {MODEL_NAME, "chat"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt="hi", max_tokens=3)
