"""The gateway's gRPC client of serving.v1.Scheduler (grpc.aio).

grpc.aio, not the sync API, so that a Generate stream is a cancellable object
on the gateway's event loop: cancelling it is how a client's disconnect reaches
the scheduler (which then frees the request's blocks). Create it inside the
running event loop that will use it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import serving_pb2, serving_pb2_grpc
from svc_common.grpc_options import channel_options


class GenerateCall(Protocol):
    """One Generate stream: iterate it for messages, cancel() it to abort the request."""

    def __aiter__(self) -> AsyncIterator[serving_pb2.GenerateResponse]: ...

    def cancel(self) -> bool: ...


class Scheduler(Protocol):
    """What the app uses of serving.v1: one scheduler (SchedulerClient) or several
    (scheduler_pool.SchedulerPool) answer alike, so the routes do not know which."""

    @property
    def target(self) -> str: ...

    def generate(self, request: serving_pb2.GenerateRequest, api_key: str | None) -> GenerateCall: ...

    async def tokenize(
        self, prompt: str, add_special_tokens: bool, return_token_strs: bool, api_key: str | None
    ) -> serving_pb2.TokenizeResponse: ...

    async def detokenize(self, token_ids: list[int], api_key: str | None) -> serving_pb2.DetokenizeResponse: ...

    async def model_info(self, api_key: str | None) -> serving_pb2.ModelInfoResponse: ...

    async def embed(
        self, prompt: str | list[int], dimensions: int | None, api_key: str | None, score: bool = False
    ) -> serving_pb2.EmbedResponse: ...

    async def check_health(self, api_key: str | None = None) -> tuple[bool, str]: ...

    async def close(self) -> None: ...


class SchedulerClient:
    def __init__(
        self,
        target: str,
        request_timeout_s: float = 0.0,
        health_timeout_s: float = 2.0,
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str = "",
    ):
        """credentials: TLS to a scheduler with --tls-cert (--scheduler-tls-ca, and a client
        certificate if given); tls_server_name: the name its certificate carries when it is
        dialled by IP (found through DNS)."""
        self._target = target
        self._request_timeout = request_timeout_s or None  # 0 = no deadline
        self._health_timeout = health_timeout_s
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target)
        else:
            options = channel_options(tls_server_name=tls_server_name)
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        self._stub = serving_pb2_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def target(self) -> str:
        return self._target

    def generate(self, request: serving_pb2.GenerateRequest, api_key: str | None) -> GenerateCall:
        """Start one Generate stream; iterate it for messages, cancel() it to abort the request."""
        call: GenerateCall = self._stub.Generate(
            request, metadata=_auth_metadata(api_key), timeout=self._request_timeout
        )
        return call

    async def tokenize(
        self, prompt: str, add_special_tokens: bool, return_token_strs: bool, api_key: str | None
    ) -> serving_pb2.TokenizeResponse:
        request = serving_pb2.TokenizeRequest(
            prompt=prompt, add_special_tokens=add_special_tokens, return_token_strs=return_token_strs
        )
        reply: serving_pb2.TokenizeResponse = await self._stub.Tokenize(
            request, metadata=_auth_metadata(api_key), timeout=self._request_timeout
        )
        return reply

    async def detokenize(self, token_ids: list[int], api_key: str | None) -> serving_pb2.DetokenizeResponse:
        request = serving_pb2.DetokenizeRequest(token_ids=token_ids)
        reply: serving_pb2.DetokenizeResponse = await self._stub.Detokenize(
            request, metadata=_auth_metadata(api_key), timeout=self._request_timeout
        )
        return reply

    async def model_info(self, api_key: str | None) -> serving_pb2.ModelInfoResponse:
        reply: serving_pb2.ModelInfoResponse = await self._stub.ModelInfo(
            serving_pb2.ModelInfoRequest(), metadata=_auth_metadata(api_key), timeout=self._health_timeout
        )
        return reply

    async def embed(
        self, prompt: str | list[int], dimensions: int | None, api_key: str | None, score: bool = False
    ) -> serving_pb2.EmbedResponse:
        request = serving_pb2.EmbedRequest(dimensions=dimensions, score=score)
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.extend(prompt)
        reply: serving_pb2.EmbedResponse = await self._stub.Embed(
            request, metadata=_auth_metadata(api_key), timeout=self._request_timeout
        )
        return reply

    async def check_health(self, api_key: str | None = None) -> tuple[bool, str]:
        """(serving?, why not) from grpc.health.v1 Check of the whole server ("")."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=self._health_timeout,
                metadata=_auth_metadata(api_key),
            )
        except grpc.aio.AioRpcError as err:
            return False, f"{err.code().name}: {err.details()}"
        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        return serving, "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        await self._channel.close(grace=None)


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None
