"""The scheduler's step path, piece by piece: the scheduler's own Planner and
KVCacheManager (built as its engine builds them) run in this process and send each
planned step to a real worker process exactly as the scheduler does (plan_to_proto,
serialized, on a plain unary call), and apply the reply with Planner.update. Every
piece is timed; the worker's own proto and validation code is timed here on the
same bytes (`worker_costs`), which the worker's reply timings do not cover.

The worker's internal modules are imported here only, inside the functions that
need them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.harness.results import ms_since
from proto import worker_pb2
from scheduler_svc.engine.worker_client import StepResult, info_from_proto, plan_to_proto, result_from_proto
from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig, RequestUpdate, StepPlan
from scheduler_svc.request import Request
from svc_common.grpc_options import channel_options


@dataclass
class DrivenStep:
    plan: StepPlan
    payload: bytes  # the StepRequest as sent
    reply: worker_pb2.StepResponse
    result: StepResult
    updates: list[RequestUpdate]
    # ms: plan, build (plan_to_proto), encode, rpc (wall), parse_reply (FromString + result_from_proto),
    # update; the worker's prepare/forward/sample/total from its reply (w_*)
    t: dict[str, float] = field(default_factory=dict)


class StepDriver:
    def __init__(self, address: str, max_num_seqs: int, prefix_caching: bool, max_waiting: int = 4096) -> None:
        self.channel = grpc.insecure_channel(address, options=channel_options())
        self._step = self.channel.unary_unary("/worker.v1.Worker/Step")  # bytes in, bytes out
        info_call = self.channel.unary_unary("/worker.v1.Worker/Info")
        reply = info_call(worker_pb2.InfoRequest().SerializeToString(), timeout=60)
        self.info = info_from_proto(address, worker_pb2.InfoResponse.FromString(reply))
        info = self.info
        pool = BlockPool(info.num_blocks, info.block_size, enable_prefix_caching=prefix_caching)
        kv = KVCacheManager(pool, extra_keys=(info.model_name, info.model_type, info.dtype, info.kv_dtype))
        config = PlannerConfig(
            max_num_batched_tokens=8192,
            max_num_seqs=max_num_seqs,
            chunk_size=8192,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            max_waiting=max_waiting,
        )
        self.planner = Planner(config, kv)
        self._planned: dict[int, float] = {}  # step id -> ms it took to plan

    def close(self) -> None:
        self.channel.close()

    def add(self, requests: list[Request]) -> None:
        for request in requests:
            self.planner.add(request)

    def schedule(self) -> StepPlan:
        start = time.perf_counter()
        plan = self.planner.schedule()
        self._planned[plan.step_id] = ms_since(start)
        return plan

    def execute(self, plan: StepPlan) -> DrivenStep:
        """Send `plan` to the worker and apply its reply, timing each piece."""
        t = {"plan": self._planned.pop(plan.step_id, 0.0)}
        start = time.perf_counter()
        message = plan_to_proto(plan)
        t["build"] = ms_since(start)
        start = time.perf_counter()
        payload = message.SerializeToString()
        t["encode"] = ms_since(start)
        start = time.perf_counter()
        reply_bytes = self._step(payload, timeout=600)
        t["rpc"] = ms_since(start)
        start = time.perf_counter()
        reply = worker_pb2.StepResponse.FromString(reply_bytes)
        result = result_from_proto(reply)
        t["parse_reply"] = ms_since(start)
        start = time.perf_counter()
        updates = self.planner.update(plan, result.samples)
        t["update"] = ms_since(start)
        timings = reply.timings
        t["w_prepare"], t["w_forward"] = timings.prepare_ms, timings.forward_ms
        t["w_sample"], t["w_total"] = timings.sample_ms, timings.total_ms
        return DrivenStep(plan, payload, reply, result, updates, t)

    def step(self) -> DrivenStep:
        return self.execute(self.schedule())

    def run_until_decoding(self, n: int) -> None:
        """Steps until every request has its first token: n sequences decoding."""
        while any(not r.output_token_ids for r in self.planner.running) or self.planner.num_waiting:
            self.step()
        if self.planner.num_running != n:
            raise RuntimeError(f"expected {n} running sequences, got {self.planner.num_running}")

    def worker_costs(self, step: DrivenStep) -> dict[str, float]:
        """The worker's request parsing (StepRequest.FromString + step_from_proto), its
        validation, and its reply building (step_to_proto + serialize), in ms: the
        worker's code on this step's bytes, timed in this process."""
        import numpy as np

        from worker_svc.step.output import SampledRows, StepOutput
        from worker_svc.step.validation import Limits, validate
        from worker_svc.step_proto import step_from_proto, step_to_proto

        info = self.info
        limits = Limits(info.vocab_size, info.num_blocks, info.block_size, info.max_model_len, info.kv_layout)
        out: dict[str, float] = {}
        start = time.perf_counter()
        step_input = step_from_proto(worker_pb2.StepRequest.FromString(step.payload))
        out["w_parse"] = ms_since(start)
        start = time.perf_counter()
        validate(step_input, limits)
        out["w_validate"] = ms_since(start)
        samples = step.result.samples
        rows = SampledRows(
            np.array(samples.seq_ids, np.uint64), np.array(samples.token_ids, np.int64), np.array(samples.logprobs)
        )
        output = StepOutput(step.reply.step_id, rows, step.reply.num_tokens, {"total_ms": step.reply.timings.total_ms})
        start = time.perf_counter()
        step_to_proto(output, step.reply.instance_id).SerializeToString()
        out["w_reply"] = ms_since(start)
        return out


def transport_ms(t: dict[str, Any]) -> float:
    """The RPC's wall time less what the worker did (its execute time, and its proto and
    validation work from worker_costs): gRPC transport and the server framework."""
    return float(t["rpc"] - t["w_total"] - t["w_parse"] - t["w_validate"] - t["w_reply"])
