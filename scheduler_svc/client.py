"""A small client for the scheduler's serving.v1 API, and a CLI that streams a
completion to stdout:

    python -m scheduler_svc.client --target 127.0.0.1:50051 --max-tokens 32 "The capital of France is"

A scheduler started with --api-keys wants one: --api-key KEY, or $PAGEDSERVE_API_KEY
(what `python -m scheduler_svc.observability.top` reads too).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from proto import serving_pb2, serving_pb2_grpc
from svc_common.cli import module_prog
from svc_common.grpc_options import DEFAULT_MAX_MESSAGE_MB, channel_options

API_KEY_ENV = "PAGEDSERVE_API_KEY"


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    progress: list[tuple[int, int]] = field(default_factory=list)
    token_logprobs: list[serving_pb2.TokenLogprob] = field(default_factory=list)  # with `logprobs`
    prompt_logprobs: list[serving_pb2.TokenLogprob] = field(default_factory=list)  # with `prompt_logprobs`


class SchedulerClient:
    def __init__(self, target: str, max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, api_key: str = ""):
        """api_key: sent as 'authorization: Bearer KEY' on every call (a scheduler with --api-keys)."""
        self.channel = grpc.insecure_channel(target, options=channel_options(max_message_mb))
        self.stub = serving_pb2_grpc.SchedulerStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def stream(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Iterator[serving_pb2.GenerateResponse]:
        """Stream raw responses. params: any GenerateRequest field (max_tokens, temperature,
        top_p, top_k, seed, stop, ignore_eos, request_id, logprobs, prompt_logprobs,
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias, min_tokens,
        stop_token_ids, ...)."""
        request = serving_pb2.GenerateRequest(prompt=prompt or "", prompt_token_ids=prompt_token_ids or [], **params)
        stream: Iterator[serving_pb2.GenerateResponse] = self.stub.Generate(
            request, timeout=timeout, metadata=self.metadata
        )
        return stream

    def generate(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Completion:
        """Run one request to the end and collect it."""
        out = Completion()
        for reply in self.stream(prompt, prompt_token_ids, timeout, **params):
            out.text += reply.text
            out.token_ids.extend(reply.token_ids)
            out.logprobs.extend(reply.logprobs)
            out.token_logprobs.extend(reply.token_logprobs)
            out.prompt_logprobs.extend(reply.prompt_logprobs)
            if reply.HasField("prefill_progress"):
                out.progress.append((reply.prefill_progress.processed_tokens, reply.prefill_progress.total_tokens))
            if reply.finished:
                out.finish_reason = reply.finish_reason
                u = reply.usage
                out.prompt_tokens, out.completion_tokens, out.cached_prompt_tokens = (
                    u.prompt_tokens,
                    u.completion_tokens,
                    u.cached_prompt_tokens,
                )
        return out

    def stats(self) -> serving_pb2.StatsResponse:
        stats: serving_pb2.StatsResponse = self.stub.Stats(serving_pb2.StatsRequest(), metadata=self.metadata)
        return stats

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=module_prog("scheduler_svc.client"), description="Stream a completion from a pagedserve scheduler."
    )
    parser.add_argument("prompt", help="the prompt text (the model's tokenizer encodes it)")
    parser.add_argument("--target", default="127.0.0.1:50051", help="the scheduler's HOST:PORT (default: %(default)s)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        help=f"sent as 'authorization: Bearer KEY', for a scheduler started with --api-keys (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: %(default)s)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with this much mass"
    )
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all")
    parser.add_argument("--seed", type=int, help="sampling seed, for a reproducible sampled completion")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat the flag for several)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds the whole completion may take (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    params = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, stop=args.stop
    )
    if args.seed is not None:
        params["seed"] = args.seed
    with SchedulerClient(args.target, api_key=args.api_key) as client:
        try:
            for reply in client.stream(args.prompt, timeout=args.timeout, **params):
                sys.stdout.write(reply.text)
                sys.stdout.flush()
                if reply.finished:
                    u = reply.usage
                    print(
                        f"\n[{reply.finish_reason}: {u.prompt_tokens} prompt tokens "
                        f"({u.cached_prompt_tokens} cached), {u.completion_tokens} generated]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
