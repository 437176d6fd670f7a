"""The gateway over several schedulers (--schedulers): one serving.v1 client per
scheduler, each request routed to one of them (prefix_routing.py), their health
watched, their dns:/// names followed.

`SchedulerPool` and `SchedulerClient` both implement the app's `Scheduler`
protocol (scheduler_client.py), so the routes do not know which one they have.
Each scheduler owns its workers and their KV blocks; the pool only picks. What
needs no KV (Tokenize, Detokenize, ModelInfo: every scheduler serves the same
model) goes to any healthy scheduler, the next one if it is UNAVAILABLE.

* **Routed around.** A scheduler whose health check fails or says NOT_SERVING
  (no worker, shutting down) gets no new request until a check says SERVING
  again. A call that fails with UNAVAILABLE before its first message (the
  scheduler just went away, or has no worker) marks it down and the request
  goes to the next scheduler in its order: nothing was generated yet, so the
  retry is invisible to the client. After the first message a failure is the
  client's, as with one scheduler.
* **Membership.** dns:/// names are resolved again every
  `--scheduler-discovery-interval-s`; a scheduler that leaves the records gets
  no new request and its channel closes once its streams have ended. A round
  in which a name does not resolve removes nobody.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import structlog
from tokenizers import Tokenizer

from gateway_svc.config import GatewayConfig
from gateway_svc.prefix_routing import HashRing, PrefixKeys, choose, least_loaded
from gateway_svc.scheduler_client import GenerateCall, Scheduler, SchedulerClient
from proto import serving_pb2
from svc_common.targets import Resolver, parse_targets, resolve_dns, resolve_targets
from svc_common.tls import channel_credentials

log = structlog.get_logger("gateway")

T = TypeVar("T")


@dataclass(eq=False)
class _Member:
    address: str
    client: SchedulerClient
    healthy: bool = True  # until a check or a call says otherwise
    why: str = ""  # the last reason it was marked down
    in_flight: int = 0  # Generate calls of this gateway on it


class SchedulerPool:
    def __init__(self, config: GatewayConfig, resolver: Resolver = resolve_dns):
        self.config = config
        self.targets = parse_targets(config.schedulers)
        self.keys = (
            PrefixKeys(Tokenizer.from_file(str(config.tokenizer_path)), config.routing_prefix_tokens)
            if config.scheduler_routing == "prefix"
            else None
        )
        self._resolver = resolver
        self._members: dict[str, _Member] = {}
        self._leaving: list[_Member] = []  # left DNS: closed once idle
        self._ring = HashRing([])
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, config: GatewayConfig, resolver: Resolver = resolve_dns) -> SchedulerPool:
        """Resolve the schedulers once, then watch health and DNS in the background.
        Create it inside the event loop that will use it (grpc.aio channels)."""
        pool = cls(config, resolver)
        await pool.refresh_members()
        pool._task = asyncio.create_task(pool._watch(), name="scheduler-pool")
        return pool

    @property
    def target(self) -> str:
        """The --schedulers list, for /health's message."""
        return self.config.schedulers

    @property
    def members(self) -> dict[str, bool]:
        """address -> healthy, for every scheduler requests may go to."""
        return {a: m.healthy for a, m in self._members.items()}

    # ---- routing ----------------------------------------------------------
    def generate(self, request: serving_pb2.GenerateRequest, api_key: str | None) -> RoutedCall:
        """Start one Generate on the scheduler routing picks (iterate it; cancel() aborts it)."""
        return RoutedCall(self._order(request), request, api_key)

    def _order(self, request: serving_pb2.GenerateRequest) -> list[_Member]:
        """The schedulers to try, the chosen one first: healthy ones (all of them if
        none is: the health view may be stale), then failover in ring or load order."""
        members = [m for m in self._members.values() if m.healthy] or list(self._members.values())
        if not members:
            return []
        loads = {m.address: m.in_flight for m in members}
        by_address = {m.address: m for m in members}
        key = self.keys.key(request.prompt, request.prompt_token_ids, request.cache_salt) if self.keys else None
        if key is not None:
            order = [a for a in self._ring.order(key) if a in by_address]
            chosen = choose(order, loads, self.config.routing_load_factor, self.config.routing_load_slack)
        else:
            order = sorted(by_address, key=loads.__getitem__)
            random_pick = self.config.scheduler_routing == "random"
            chosen = random.choice(order) if random_pick else least_loaded(order, loads)
        log.debug("request routed", scheduler=chosen, keyed=key is not None, load=loads[chosen])
        return [by_address[chosen], *(by_address[a] for a in order if a != chosen)]

    # ---- calls any scheduler answers alike ------------------------------------
    async def tokenize(
        self, prompt: str, add_special_tokens: bool, return_token_strs: bool, api_key: str | None
    ) -> serving_pb2.TokenizeResponse:
        return await self._any(lambda c: c.tokenize(prompt, add_special_tokens, return_token_strs, api_key))

    async def detokenize(self, token_ids: list[int], api_key: str | None) -> serving_pb2.DetokenizeResponse:
        return await self._any(lambda c: c.detokenize(token_ids, api_key))

    async def model_info(self, api_key: str | None) -> serving_pb2.ModelInfoResponse:
        return await self._any(lambda c: c.model_info(api_key))

    async def embed(
        self, prompt: str | list[int], dimensions: int | None, api_key: str | None, score: bool = False
    ) -> serving_pb2.EmbedResponse:
        return await self._any(lambda c: c.embed(prompt, dimensions, api_key, score))

    async def _any(self, call: Callable[[SchedulerClient], Awaitable[T]]) -> T:
        """`call` on a healthy scheduler; UNAVAILABLE moves on to the next (marking it down)."""
        members = sorted(self._members.values(), key=lambda m: (not m.healthy, m.in_flight))
        if not members:
            raise _unavailable("no scheduler is known (--schedulers resolved to nothing)")
        for member in members[:-1]:
            try:
                return await call(member.client)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                member.healthy, member.why = False, f"UNAVAILABLE: {err.details()}"
        return await call(members[-1].client)

    # ---- health and membership ------------------------------------------------
    async def check_health(self, api_key: str | None = None) -> tuple[bool, str]:
        """Serving if any scheduler is (each one's health is refreshed on the way)."""
        await self.check_members(api_key)
        if any(m.healthy for m in self._members.values()):
            return True, ""
        return False, "; ".join(f"{a}: {m.why}" for a, m in self._members.items()) or "no scheduler found"

    async def check_members(self, api_key: str | None = None) -> None:
        members = list(self._members.values())
        results = await asyncio.gather(*(m.client.check_health(api_key) for m in members))
        for member, (serving, why) in zip(members, results):
            if serving != member.healthy:
                log.info("scheduler health", scheduler=member.address, serving=serving, why=why)
            member.healthy, member.why = serving, why

    async def refresh_members(self) -> None:
        resolved = await resolve_targets(self.targets, self._resolver)
        for address in resolved.peers.keys() - self._members.keys():
            target = resolved.peers[address]
            self._members[address] = _Member(address, self._client(address, target.host if target.dns else ""))
            log.info("scheduler joined", scheduler=address)
        if not resolved.failed:
            for address in self._members.keys() - resolved.peers.keys():
                self._leaving.append(self._members.pop(address))
                log.info("scheduler left", scheduler=address)
        self._ring = HashRing(list(self._members))
        for member in [m for m in self._leaving if m.in_flight == 0]:
            self._leaving.remove(member)
            await member.client.close()

    async def _watch(self) -> None:
        health_s = self.config.scheduler_health_interval_s
        every = max(1, round(self.config.scheduler_discovery_interval_s / health_s))
        rounds = 0
        while True:
            await asyncio.sleep(health_s)
            rounds += 1
            try:
                if rounds % every == 0 and any(t.dns for t in self.targets):
                    await self.refresh_members()
                await self.check_members()
            except Exception:  # a bug must not end the watch: the next round tries again
                log.exception("scheduler pool round failed")

    def _client(self, address: str, tls_server_name: str) -> SchedulerClient:
        return scheduler_client(self.config, address, tls_server_name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for member in [*self._members.values(), *self._leaving]:
            await member.client.close()


class RoutedCall:
    """One Generate over the pool, iterated and cancelled like grpc.aio's call.

    UNAVAILABLE before the first message marks the scheduler down and moves on to
    the next one in the order; any other error, or one after output began, is the
    caller's. The in-flight count of the scheduler holding the call is what load
    routing reads."""

    def __init__(self, order: list[_Member], request: serving_pb2.GenerateRequest, api_key: str | None):
        self._order = order
        self._request = request
        self._api_key = api_key
        self._call: GenerateCall | None = None
        self._holder: _Member | None = None
        self._cancelled = False
        if order:
            self._hold(order[0])  # counted now: the next request routed sees this one

    def __aiter__(self) -> AsyncIterator[serving_pb2.GenerateResponse]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[serving_pb2.GenerateResponse]:
        if not self._order:
            raise _unavailable("no scheduler is known (--schedulers resolved to nothing)")
        try:
            for attempt, member in enumerate(self._order):
                if self._cancelled:
                    return
                self._hold(member)
                self._call = member.client.generate(self._request, self._api_key)
                started = False
                try:
                    async for message in self._call:
                        started = True
                        yield message
                    return
                except grpc.aio.AioRpcError as err:
                    last = attempt == len(self._order) - 1
                    if started or self._cancelled or last or err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    member.healthy, member.why = False, f"UNAVAILABLE: {err.details()}"
                    log.warning("scheduler unavailable; trying the next", scheduler=member.address, error=err.details())
        finally:
            self._release()

    def cancel(self) -> bool:
        self._cancelled = True
        self._release()
        return self._call.cancel() if self._call is not None else False

    def _hold(self, member: _Member) -> None:
        if self._holder is not member:
            self._release()
            member.in_flight += 1
            self._holder = member

    def _release(self) -> None:
        if self._holder is not None:
            self._holder.in_flight -= 1
            self._holder = None


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    """The error a scheduler would give, so the app answers 503 the usual way."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def open_scheduler_client(config: GatewayConfig) -> Scheduler:
    """--schedulers: a pool; otherwise the one --scheduler, as always."""
    if config.schedulers:
        return await SchedulerPool.open(config)
    return scheduler_client(config, config.scheduler)


def scheduler_client(config: GatewayConfig, address: str, tls_server_name: str = "") -> SchedulerClient:
    """A client of one scheduler, with TLS when --scheduler-tls-ca is set."""
    credentials = channel_credentials(config.scheduler_tls_ca, config.scheduler_tls_cert, config.scheduler_tls_key)
    name = tls_server_name if credentials else ""
    return SchedulerClient(address, config.request_timeout_s, config.health_timeout_s, credentials, name)
