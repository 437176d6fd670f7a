"""serving.v1 Generate from asyncio tests (grpc.aio), read to its last reply (no torch)."""

from __future__ import annotations

from proto import serving_pb2


async def generate(stub, ids: list[int], max_tokens: int) -> serving_pb2.GenerateResponse:
    """A greedy request of token ids that runs to max_tokens (ignore_eos); its final reply."""
    replies = [
        r
        async for r in stub.Generate(
            serving_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True),
            timeout=30,
        )
    ]
    assert replies[-1].finished
    return replies[-1]
