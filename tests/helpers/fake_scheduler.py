"""A fake serving.v1 scheduler in process (no model, no torch) and real uvicorn
gateways in front of it, for the gateway's tests.

The fake streams canned deltas and records every GenerateRequest, its gRPC
metadata and whether its call was cancelled; `serve_fake_scheduler` runs it on
127.0.0.1 with grpc.health.v1; `running_gateway` runs a gateway on 127.0.0.1
port 0 in a background thread; `chat_model_dir` writes a model directory with a
small chat template."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway_svc.config import GatewayConfig
from gateway_svc.server import GatewayServer
from proto import serving_pb2, serving_pb2_grpc

MODEL_NAME = "tiny-chat-model"
# A small template in tokenizer_config.json that uses bos/eos and raise_exception.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if loop.first and m['role'] == 'assistant' %}{{ raise_exception('conversation must not start with assistant') }}{% endif %}"  # noqa: E501
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DELTAS = ["Hello", ",", " world"]
USAGE = serving_pb2.Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=4)
WAIT_S = 60.0  # upper bound on any single wait in these tests (a hang detector: 10 s timed out at load 20+)


# ---------------------------------------------------------------- fake scheduler


class FakeScheduler(serving_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[serving_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = threading.Event()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.metadata.clear()
        self.cancelled.clear()
        self.deltas = list(DELTAS)
        self.delay_s = 0.0  # before each delta
        self.first_delay_s = 0.0  # before the first message (a long queue wait or prefill)
        self.finish_reason = "length"
        self.stop_string: str | None = None  # the last message names it (a stop string ended the answer)
        self.abort: tuple[grpc.StatusCode, str] | None = None
        self.abort_after: int | None = None  # with `abort`: fail after this many deltas (mid-stream)
        self.required_key: str | None = None
        self.active = 0  # Generate calls running now, and the most there were at once
        self.max_active = 0
        self.lora_adapters = None

    def Generate(self, request, context):
        metadata = dict(context.invocation_metadata())
        with self.lock:
            self.requests.append(request)
            self.metadata.append(metadata)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            yield from self._generate(request, context, metadata)
        finally:
            with self.lock:
                self.active -= 1

    def Tokenize(self, request, context):
        """One token per character: what a streamed answer counts before its usage arrives."""
        self._check_key(context, dict(context.invocation_metadata()))
        return serving_pb2.TokenizeResponse(token_ids=[ord(c) for c in request.prompt])

    def ModelInfo(self, request, context):
        """Past the key check (as the real scheduler's), no model to describe, unless a test
        gave it LoRA adapters (`lora_adapters`: () -> their LoraAdapterInfo)."""
        self._check_key(context, dict(context.invocation_metadata()))
        if self.lora_adapters is not None:
            return serving_pb2.ModelInfoResponse(model=MODEL_NAME, max_model_len=64, lora_adapters=self.lora_adapters())
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the fake scheduler describes no model")

    def _check_key(self, context, metadata):
        if self.required_key and metadata.get("authorization") != f"Bearer {self.required_key}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this scheduler wants an API key")

    def _generate(self, request, context, metadata):
        self._check_key(context, metadata)
        if self.abort and self.abort_after is None:
            context.abort(*self.abort)
        completed = False
        try:
            if not self._wait(context, self.first_delay_s):
                return
            # A progress-only message first: the gateway must not turn it into output.
            yield serving_pb2.GenerateResponse(
                request_id=request.request_id,
                prefill_progress=serving_pb2.PrefillProgress(processed_tokens=5, total_tokens=5),
            )
            for i, text in enumerate(self.deltas):
                if not self._wait(context, self.delay_s):
                    return
                if self.abort and i == self.abort_after:
                    completed = True  # an error, not a cancellation
                    context.abort(*self.abort)
                yield serving_pb2.GenerateResponse(request_id=request.request_id, text=text, token_ids=[i])
            yield serving_pb2.GenerateResponse(
                request_id=request.request_id,
                finished=True,
                finish_reason=self.finish_reason,
                usage=USAGE,
                stop_string=self.stop_string,
            )
            completed = True
        finally:
            if not completed:
                self.cancelled.set()

    @staticmethod
    def _wait(context, seconds: float) -> bool:
        """Sleep up to `seconds`; False as soon as the call is cancelled."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not context.is_active():
                return False
            time.sleep(0.005)
        return context.is_active()


@contextlib.contextmanager
def serve_fake_scheduler() -> Iterator[FakeScheduler]:
    """The fake on 127.0.0.1 (its `address`), health SERVING (its `health` servicer)."""
    servicer, health_servicer = FakeScheduler(), health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    serving_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.address = f"127.0.0.1:{port}"
    servicer.health = health_servicer
    try:
        yield servicer
    finally:
        server.stop(grace=None)


def chat_model_dir(directory: Path) -> Path:
    """`directory`/MODEL_NAME with CHAT_TEMPLATE in its tokenizer_config.json."""
    model = directory / MODEL_NAME
    model.mkdir()
    (model / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    return model


@contextlib.contextmanager
def running_gateway(**overrides):
    """A real uvicorn gateway on 127.0.0.1 port 0, in a background thread."""
    config = GatewayConfig(**{"host": "127.0.0.1", "port": 0, "log_level": "warning", **overrides})
    config.validate()
    server = GatewayServer(config)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        assert server.ready.wait(WAIT_S), "gateway did not start"
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()
        thread.join(WAIT_S)
        assert not thread.is_alive(), "gateway did not stop"


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def sse_payloads(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a fully read event stream, checking the framing."""
    text = response.text
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]
