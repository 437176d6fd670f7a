"""LoRA adapters as OpenAI models: a request's `model` names the base model or an
adapter the scheduler serves (serving.v1 GenerateRequest.lora_adapter); /v1/models
lists the adapters with the base as `parent`; /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's bodies) call the scheduler's admin.v1 with the
caller's key, which admin.v1 checks against its admin keys (a client key is refused).

The adapter names come from the scheduler's ModelInfo, fetched again when a request
names a model this gateway does not know (at most once a second), with /v1/models'
ModelInfo, and after this gateway loads or unloads one."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from gateway_svc import errors
from gateway_svc.auth import forwarded_key
from gateway_svc.openapi import ERROR_RESPONSES
from gateway_svc.scheduler_client import Scheduler
from proto import admin_pb2, admin_pb2_grpc, serving_pb2

_REFRESH_MIN_S = 1.0


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify an adapter here


class LoraModels:
    def __init__(self, base: str) -> None:
        self.base = base
        self.adapters: dict[str, str] = {}  # name -> the directory it was loaded from
        self._fetched_at = -float("inf")

    def served(self, model: str | None) -> None:
        """The base, an adapter, or no model at all; another name is a 404."""
        if model and model != self.base and model not in self.adapters:
            raise errors.model_not_found(model)

    def adapter(self, model: str | None) -> str | None:
        """The adapter a served `model` selects (None: the base)."""
        return model if model and model != self.base else None

    async def learn(self, client: Scheduler, model: str | None, api_key: str | None) -> None:
        """Fetch the adapter names again when `model` is one this gateway does not know."""
        unknown = model and model != self.base and model not in self.adapters
        if unknown and time.monotonic() - self._fetched_at >= _REFRESH_MIN_S:
            with contextlib.suppress(grpc.aio.AioRpcError):  # the scheduler cannot say: the name stays unknown (404)
                await self.refresh(client, api_key)

    async def refresh(self, client: Scheduler, api_key: str | None) -> None:
        self.learnt(await client.model_info(api_key))

    def learnt(self, info: serving_pb2.ModelInfoResponse) -> None:
        self.adapters = {a.name: a.path for a in info.lora_adapters}
        self._fetched_at = time.monotonic()

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [self.card(name, created) for name in sorted(self.adapters)]

    def card(self, name: str, created: int) -> dict[str, Any]:
        """vLLM's model card of an adapter: `root` its directory, `parent` the base."""
        path = self.adapters[name]
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagedserve",
            "root": path,
            "parent": self.base,
        }


def lora_admin_router(models: LoraModels, client: Scheduler, admin_target: str, credentials: Any) -> APIRouter:
    """The two admin routes over admin.v1 at `admin_target` (the gateway's --scheduler-admin)."""
    router = APIRouter()
    channel: list[grpc.aio.Channel] = []  # opened on first use, inside the serving loop

    def stub() -> admin_pb2_grpc.AdminStub:
        if not channel:
            channel.append(
                grpc.aio.secure_channel(admin_target, credentials)
                if credentials is not None
                else grpc.aio.insecure_channel(admin_target)
            )
        return admin_pb2_grpc.AdminStub(channel[0])

    async def call(request: Request, method: str, message: Any) -> None:
        key = forwarded_key(request)
        if not key:
            raise errors.OpenAIError(401, "the LoRA admin routes need an admin key", "authentication_error")
        try:
            await getattr(stub(), method)(message, metadata=(("authorization", f"Bearer {key}"),), timeout=60)
        except grpc.aio.AioRpcError as err:
            raise errors.grpc_error(err.code(), err.details()) from None
        await models.refresh(client, key)

    @router.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)
    async def load(body: LoadLoraAdapter, request: Request) -> PlainTextResponse:
        await call(request, "LoadLoraAdapter", admin_pb2.LoadLoraAdapterRequest(**body.model_dump()))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES)
    async def unload(body: UnloadLoraAdapter, request: Request) -> PlainTextResponse:
        await call(request, "UnloadLoraAdapter", admin_pb2.UnloadLoraAdapterRequest(lora_name=body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
