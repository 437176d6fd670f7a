"""Prefill/decode disaggregation: a request's prompt runs on a prefill-role worker;
once its first token is sampled there, it moves to a decode-role worker with its KV.

The move is built from the pieces every request already uses, so that nothing but
the blocks is new. On the decode worker's pool the scheduler takes the full blocks
of the computed prompt under a scratch id: those the decode worker's prefix index
already holds are shared (no bytes move), the rest are allocated, and the decode
worker pulls them from the prefill worker by id (worker.v1 FetchBlocks ->
ReadBlocks). Once written they are indexed under their hashes (where the decode
worker has a prefix cache) and stay held for the request, which is added to the
decode worker's planner like any moved request: its admission takes the blocks as
its computed prefix (planning/received.py; with or without prefix caching, and
safe from eviction meanwhile) and computes only the last partial block and the
first token (fewer than block_size + 1 tokens), then samples the second. The
prefill worker's blocks are freed into its prefix cache.

Failures recompute, as everywhere: a transfer that fails (the prefill worker died,
restarted, or the decode worker refused) indexes nothing, and the request still
moves and computes its prompt on the decode worker; a prefill worker lost before
the move hands its requests over (engine/flow.py), routed by `pool` again. With no
decode worker able to take a request it stays and decodes where it is.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.errors import WorkerCallFailed, WorkerUnavailable
from scheduler_svc.engine.fleet import Fleet
from scheduler_svc.engine.router import Candidate, NoWorkerAvailable, Router, WorkerState
from scheduler_svc.planning.queues import QueueFull
from scheduler_svc.planning.validation import RequestRejected
from scheduler_svc.request import Request, RequestStatus

log = structlog.get_logger(__name__)

PREFILL, DECODE, BOTH = "prefill", "decode", "both"

# Where a moved request now lives (the flow's owner map follows it).
Moved = Callable[[Request, EngineCore], None]


@dataclass(slots=True)
class _Transfer:
    """Blocks held on the decode worker's pool under a scratch id while they are written."""

    scratch: Request
    src_ids: list[int]  # the prefill worker's blocks to read ...
    dst_ids: list[int]  # ... into these of the decode worker
    skipped: int  # leading blocks the decode worker already holds
    full_tokens: int  # tokens of the full blocks (hits and moved)


@dataclass(frozen=True, slots=True)
class _Generations:
    """What changes when a move's blocks can no longer be trusted."""

    preemptions: int
    src_failures: int
    dst_failures: int
    dst_instance: str

    @classmethod
    def of(cls, src: EngineCore, target: EngineCore, request: Request) -> _Generations:
        failures = (src.counters.worker_failures, target.counters.worker_failures)
        return cls(request.num_preemptions, *failures, target.info.instance_id)


def can_move(request: Request) -> bool:
    """A request whose decode can run elsewhere: one sample (no fork), no pooling, and
    a token to generate after the first."""
    return (
        not request.children
        and not request.prefill_only
        and request.pooling is None
        and request.sampling.max_tokens > request.num_output_tokens + 1
    )


class KvHandoff:
    def __init__(self, fleet: Fleet, router: Router, moved: Moved) -> None:
        self.fleet = fleet
        self.router = router
        self.moved = moved
        self._moving: dict[str, asyncio.Task[None]] = {}
        self._transfer_ids = itertools.count(1)
        fleet.on_applied(self.on_applied)

    def pool(self, request: Request, cores: list[EngineCore]) -> list[EngineCore]:
        """The cores to route `request` among, and whether it hands off: with prefill and
        other workers serving, a request that can move goes to the prefill workers (and
        will leave after its next token); any other to the rest. Without roles: `cores`."""
        serving = [c for c in cores if self.fleet.state(c) is WorkerState.SERVING]
        prefill = [c for c in serving if c.info.kv_role == PREFILL]
        others = [c for c in serving if c.info.kv_role != PREFILL]
        request.kv_handoff_at = 0
        if prefill and others and can_move(request):
            request.kv_handoff_at = request.num_output_tokens + 1
            return prefill
        return others or cores

    @property
    def num_moving(self) -> int:
        return len(self._moving)

    def on_applied(self, core: EngineCore) -> None:
        """After a prefill worker's step: start moving the requests whose token is out."""
        if core.info.kv_role != PREFILL:
            return
        for request in core.planner.running:
            rid = request.request_id
            if rid in self._moving or not request.hands_off():
                continue
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # its last token's KV is not all written yet
            self._moving[rid] = asyncio.create_task(self._move(core, request), name=f"kv-handoff-{rid}")

    async def close(self) -> None:
        tasks = list(self._moving.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one move -------------------------------------------------------------
    async def _move(self, src: EngineCore, request: Request) -> None:
        try:
            await self._transfer_and_move(src, request)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not strand the request: it decodes where it is
            log.exception("kv handoff failed", request_id=request.request_id)
            request.kv_handoff_at = 0
        finally:
            self._moving.pop(request.request_id, None)

    async def _transfer_and_move(self, src: EngineCore, request: Request) -> None:
        target = self._target(src, request)
        if target is None:
            self._stay(src, request, "no decode worker can take it")
            return
        before = _Generations.of(src, target, request)
        transfer = self._hold(src, target, request)
        moved = False
        if transfer is not None:
            moved = await self._fetch(src, target, transfer)
        # Meanwhile the request may have ended, been preempted or requeued (its blocks
        # freed, maybe rewritten while they were read), or either worker lost or
        # restarted: then nothing read is trusted.
        still = src.planner.requests.get(request.request_id) is request and request.status is RequestStatus.RUNNING
        unchanged = _Generations.of(src, target, request) == before
        keep = moved and still and unchanged and target.healthy
        if transfer is not None and not keep:
            self._release(target, transfer)
        if not still or not unchanged:
            return  # ended, or preempted or requeued on its prefill worker: it goes on there, and moves again later
        decode, received = target, False
        try:
            taken, streams = src.hand_off(request.request_id)
            taken.kv_handoff_at = 0
            try:
                target.adopt(taken)
            except (QueueFull, RequestRejected, WorkerUnavailable) as exc:
                log.warning("decode worker refused a moved request", request_id=taken.request_id, error=str(exc))
                target = src  # it recomputes where it was prefilled, from that worker's prefix cache
                target.adopt(taken)
            else:
                if transfer is not None and keep:
                    self._receive(target, taken, transfer)
                    received = True
        finally:
            if transfer is not None and keep and not received:
                self._release(decode, transfer)  # the request went elsewhere, or a bug: they hold nothing of its
        target.adopt_streams(streams)
        self.moved(taken, target)
        target.counters.kv_transfers.handoffs += target is not src
        log.debug(
            "request handed off",
            request_id=taken.request_id,
            src=src.info.address,
            dst=target.info.address,
            kv_moved=moved,
            blocks=len(transfer.dst_ids) if transfer else 0,
            blocks_skipped=transfer.skipped if transfer else 0,
        )

    def _target(self, src: EngineCore, request: Request) -> EngineCore | None:
        """The decode worker the router picks (the one holding most of the prompt first)."""
        cores = [
            c
            for c in self.fleet.serving_cores()
            if c.info.kv_role != PREFILL and _same_kv(c, src) and c.info.kv_layout == "paged"
        ]
        if not cores:
            return None
        try:
            decision = self.router.route(request, [Candidate.from_core(c, WorkerState.SERVING) for c in cores])
        except NoWorkerAvailable:
            return None
        return next(c for c in cores if c.info.address == decision.address)

    def _stay(self, src: EngineCore, request: Request, why: str) -> None:
        request.kv_handoff_at = 0
        src.counters.kv_transfers.stayed += 1
        log.info("request decodes on its prefill worker", request_id=request.request_id, reason=why)

    def _hold(self, src: EngineCore, target: EngineCore, request: Request) -> _Transfer | None:
        """Take the prompt's full blocks on the decode worker's pool: its prefix hits
        shared, the others allocated for the transfer; None if there are none to take
        or no room."""
        kv = target.planner.kv
        full = request.num_computed_tokens // kv.block_size
        if full == 0:
            return None
        # One token past the full blocks: every full block may then be a hit.
        scratch = Request(
            request_id=f"{request.request_id}#kv",
            seq_id=0,
            prompt_token_ids=request.all_token_ids[: full * kv.block_size + 1],
            cache_salt=request.cache_salt,
        )
        hits, hit_tokens = kv.get_computed_blocks(scratch)
        if kv.allocate_slots(scratch, full * kv.block_size - hit_tokens, hits) is None:
            return None
        scratch.num_computed_tokens = full * kv.block_size
        target.planner.held.add(scratch.request_id)
        dst = kv.block_table(scratch.request_id)
        src_ids = src.planner.kv.block_table(request.request_id)[len(hits) : full]
        return _Transfer(scratch, src_ids, dst[len(hits) : full], len(hits), full * kv.block_size)

    async def _fetch(self, src: EngineCore, target: EngineCore, transfer: _Transfer) -> bool:
        counters = target.counters.kv_transfers
        counters.blocks_skipped += transfer.skipped
        if not transfer.dst_ids:
            return True  # the decode worker holds the whole prompt already
        transfer_id = next(self._transfer_ids)
        counters.in_flight += 1
        started = time.perf_counter()
        try:
            result = await target.client.fetch_blocks(
                transfer_id,
                src.info,
                target.info.instance_id,
                transfer.src_ids,
                transfer.dst_ids,
                src.client.tls_server_name,  # dialled by pod IP: the name its certificate carries
            )
        except WorkerCallFailed as err:
            counters.failed += 1
            log.warning(
                "kv transfer failed: the request recomputes its prompt",
                transfer_id=transfer_id,
                src=src.info.address,
                dst=target.info.address,
                code=err.reason,
                details=err.details,
            )
            return False
        finally:
            counters.in_flight -= 1
        counters.transfers += 1
        counters.blocks += result.blocks
        counters.bytes += result.bytes
        counters.seconds += time.perf_counter() - started
        return True

    def _receive(self, target: EngineCore, request: Request, transfer: _Transfer) -> None:
        """The blocks hold the prompt's KV now: indexed under their hashes (the decode
        worker's prefix cache, when it has one) and held for the request until its
        admission there takes them (planning/received.py)."""
        kv = target.planner.kv
        kv.cache_full_blocks(transfer.scratch, transfer.full_tokens)
        target.planner.held.discard(transfer.scratch.request_id)
        target.planner.received.attach(request.request_id, transfer.scratch)

    def _release(self, target: EngineCore, transfer: _Transfer) -> None:
        """Free the transfer's blocks holding nothing (it failed, or its request cannot take them)."""
        target.planner.kv.free(transfer.scratch)
        target.planner.held.discard(transfer.scratch.request_id)


def _same_kv(a: EngineCore, b: EngineCore) -> bool:
    """Blocks copy byte for byte only between pools that lay them out alike."""
    return a.info.kv_dtype == b.info.kv_dtype and a.info.kv_bytes_per_block == b.info.kv_bytes_per_block
