"""The scheduler never imports torch: every scheduler module is imported and a
request runs through the real server and engine against a fake worker, in a
fresh interpreter, and torch must still be absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import REPO

SCRIPT = textwrap.dedent("""
    import asyncio, importlib, pkgutil, sys
    import grpc
    import scheduler_svc
    from proto import serving_pb2, serving_pb2_grpc
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.engine.engine import Engine
    from scheduler_svc.api.server import start_server
    from scheduler_svc.text.tokenizer import load_tokenizer
    from tests.helpers.fake_worker_server import audit_engine, start_fake_worker

    for mod in pkgutil.walk_packages(scheduler_svc.__path__, "scheduler_svc."):
        importlib.import_module(mod.name)

    async def main(model_dir):
        tokenizer = load_tokenizer(model_dir)
        worker, address, _ = await start_fake_worker(num_blocks=32, vocab_size=tokenizer.vocab_size)
        engine = await Engine.connect(SchedulerConfig(workers=address, model=model_dir), tokenizer)
        server, port = await start_server(engine, "127.0.0.1", 0, 16, 16)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = serving_pb2_grpc.SchedulerStub(channel)
            replies = [r async for r in stub.Generate(serving_pb2.GenerateRequest(prompt="hello there", max_tokens=5,
                                                                                  temperature=0, ignore_eos=True))]
        await server.stop(None)
        await engine.stop()
        await worker.stop(None)
        assert replies[-1].finished and replies[-1].usage.completion_tokens == 5, replies
        audit_engine(engine)

    asyncio.run(main(sys.argv[1]))
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, loaded
    print("no torch")
""")


def test_scheduler_runs_a_request_without_importing_torch():
    model_dir = tiny_checkpoint("llama")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("no torch")
