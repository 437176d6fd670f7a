"""The gateway's gRPC client of serving.v1.Scheduler (grpc.aio).

grpc.aio, not the sync API, so that a Generate stream is a cancellable object
on the gateway's event loop: cancelling it is how a client's disconnect reaches
the scheduler (which then frees the request's blocks). Create it inside the
running event loop that will use it.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import serving_pb2, serving_pb2_grpc


class SchedulerClient:
    def __init__(self, target: str, request_timeout_s: float = 0.0, health_timeout_s: float = 2.0):
        self.target = target
        self._request_timeout = request_timeout_s or None  # 0 = no deadline
        self._health_timeout = health_timeout_s
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = serving_pb2_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, request: serving_pb2.GenerateRequest, api_key: str | None) -> grpc.aio.UnaryStreamCall:
        """Start one Generate stream; iterate it for messages, cancel() it to abort the request."""
        return self._stub.Generate(request, metadata=_auth_metadata(api_key), timeout=self._request_timeout)

    async def tokenize(
        self, prompt: str, add_special_tokens: bool, return_token_strs: bool, api_key: str | None
    ) -> serving_pb2.TokenizeResponse:
        request = serving_pb2.TokenizeRequest(
            prompt=prompt, add_special_tokens=add_special_tokens, return_token_strs=return_token_strs
        )
        return await self._stub.Tokenize(request, metadata=_auth_metadata(api_key), timeout=self._request_timeout)

    async def detokenize(self, token_ids: list[int], api_key: str | None) -> serving_pb2.DetokenizeResponse:
        request = serving_pb2.DetokenizeRequest(token_ids=token_ids)
        return await self._stub.Detokenize(request, metadata=_auth_metadata(api_key), timeout=self._request_timeout)

    async def model_info(self, api_key: str | None) -> serving_pb2.ModelInfoResponse:
        return await self._stub.ModelInfo(
            serving_pb2.ModelInfoRequest(), metadata=_auth_metadata(api_key), timeout=self._health_timeout
        )

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
