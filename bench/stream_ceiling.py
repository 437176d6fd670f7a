"""A serving.v1 stub for bench/loop.py's part C: `Generate` streams max_tokens
messages of one token each, as fast as gRPC takes them, with no scheduler, no
worker and no tokenizer behind it. The same client driving the same N streams
against it measures what one Python gRPC server process can stream on this
machine: the ceiling the real scheduler's loop runs under, measured in the
same run.

    python -m bench.stream_ceiling --port 0 --ready-file FILE
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import grpc

from proto import serving_pb2, serving_pb2_grpc
from svc_common.grpc_options import server_options
from svc_common.ready_file import write_ready_file


class StubScheduler(serving_pb2_grpc.SchedulerServicer):
    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        # What the scheduler sends per decoded token: the id, its text and logprob.
        for i in range(request.max_tokens):
            yield serving_pb2.GenerateResponse(
                request_id="stub",
                text=" tok",
                token_ids=[i % 100],
                logprobs=[-0.5],
                finished=i + 1 == request.max_tokens,
            )


async def serve(host: str, port: int, ready_file: str) -> None:
    server = grpc.aio.server(options=server_options())
    serving_pb2_grpc.add_SchedulerServicer_to_server(StubScheduler(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    write_ready_file(ready_file, host, bound)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", default="")
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.ready_file))


if __name__ == "__main__":
    main()
