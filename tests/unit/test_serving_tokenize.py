"""serving.v1 Tokenize, Detokenize and ModelInfo over a real gRPC server and
engine, in-process (a fake worker, the tiny checkpoint's tokenizer), checked
against the `tokenizers` library on the same tokenizer.json."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from tokenizers import Tokenizer

from proto import serving_pb2, serving_pb2_grpc
from scheduler_svc.api.server import start_server
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from scheduler_svc.text.tokenizer import load_tokenizer
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.fake_worker_server import start_fake_worker

TEXT = "The quick brown fox, naïvely."


def test_tokenize_detokenize_model_info():
    model_dir = tiny_checkpoint("llama")
    tokenizer = load_tokenizer(model_dir)
    reference = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    async def main():
        worker, address, _ = await start_fake_worker(num_blocks=64, vocab_size=tokenizer.vocab_size, max_model_len=512)
        engine = await Engine.connect(SchedulerConfig(workers=address, max_model_len=300), tokenizer)
        server, port = await start_server(engine, "127.0.0.1", 0, 16, 16)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = serving_pb2_grpc.SchedulerStub(channel)
                reply = await stub.Tokenize(serving_pb2.TokenizeRequest(prompt=TEXT, return_token_strs=True))
                want = reference.encode(TEXT, add_special_tokens=True)
                assert list(reply.token_ids) == want.ids and list(reply.token_strs) == want.tokens
                assert reply.max_model_len == 300
                plain = await stub.Tokenize(serving_pb2.TokenizeRequest(prompt=TEXT, add_special_tokens=False))
                assert list(plain.token_ids) == reference.encode(TEXT, add_special_tokens=False).ids
                assert not plain.token_strs
                back = await stub.Detokenize(serving_pb2.DetokenizeRequest(token_ids=reply.token_ids))
                assert back.text == reference.decode(want.ids, skip_special_tokens=False)
                info = await stub.ModelInfo(serving_pb2.ModelInfoRequest())
                assert (info.model, info.max_model_len, info.vocab_size) == ("fake", 300, tokenizer.vocab_size)
                with pytest.raises(grpc.aio.AioRpcError) as empty:
                    await stub.Tokenize(serving_pb2.TokenizeRequest(prompt=""))
                assert empty.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert empty.value.details().startswith("prompt:")
                with pytest.raises(grpc.aio.AioRpcError) as outside:
                    await stub.Detokenize(serving_pb2.DetokenizeRequest(token_ids=[5, tokenizer.vocab_size]))
                assert outside.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert outside.value.details() == (
                    f"token_ids: token id {tokenizer.vocab_size} is outside the vocabulary [0, {tokenizer.vocab_size})"
                )
        finally:
            await server.stop(None)
            await engine.stop()
            await worker.stop(None)

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("special", [True, False])
def test_large_texts_take_the_thread_path_and_answer_alike(special):
    """encode_async / decode_async run large inputs in a thread through the library's batch
    calls (which release the GIL): same ids and text as the plain calls, both directions."""
    from scheduler_svc.text.tokenizer import INLINE_CHARS, INLINE_IDS

    tokenizer = load_tokenizer(tiny_checkpoint("llama"))
    text = (TEXT + " 日本語 <s> ") * (INLINE_CHARS // len(TEXT) + 10)
    ids = tokenizer.encode(text, add_special_tokens=special)
    assert len(text) > INLINE_CHARS and len(ids) > INLINE_IDS

    async def main():
        assert await tokenizer.encode_async(text, add_special_tokens=special) == ids
        assert await tokenizer.decode_async(ids, skip_special_tokens=special) == tokenizer.decode(ids, special)

    asyncio.run(main())
