"""No request takes the scheduler down or crosses what its keys allow (issue 35, the
scheduler's items), through real processes on 127.0.0.1:

* 1/7: the grammar that segfaulted the scheduler (a chain of 3,000 Lark rules), a
  10,000-level schema and a choice with a control character are refused by name,
  and a stream running meanwhile ends intact;
* 4: admin.v1 AddWorker to an address the scheduler was not configured to trust is
  refused, and that listener never hears from the scheduler (no internal token);
* 8: one API key's pins hold at most its share of the pool, only it unpins them, and
  they expire after --pin-ttl-s.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from proto import admin_pb2, admin_pb2_grpc, serving_pb2, serving_pb2_grpc
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.deep_constraints import nested_schema, rule_chain
from tests.helpers.procs import Cluster, free_port

WAIT_S = 120
KEY_A, KEY_B = "hardening-key-a", "hardening-key-b"
NUM_BLOCKS = 64
PIN_SHARE = 0.125  # 8 of the 64 blocks per key
PIN_TTL_S = 4.0
ALLOWED_PORT = free_port()  # a trap listener the scheduler is told to trust (the control)


class TrapListener:
    """A gRPC server answering nothing, recording the metadata of every call that reaches it."""

    def __init__(self, port: int = 0) -> None:
        self.calls: list[dict[str, str]] = []
        self._lock = threading.Lock()
        trap = self

        class Record(grpc.GenericRpcHandler):
            def service(self, details):
                with trap._lock:
                    trap.calls.append(dict(details.invocation_metadata))
                return None  # UNIMPLEMENTED

        self.server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[Record()])
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture(scope="module")
def cell():
    with Cluster(
        tiny_checkpoint("llama"),
        ["--dtype", "float32", "--num-blocks", str(NUM_BLOCKS)],
        [
            "--api-keys",
            f"{KEY_A},{KEY_B}",
            "--max-grammar-rules",
            "6000",  # past the default: the repro reaches the compile sandbox
            "--max-pin-share-per-key",
            str(PIN_SHARE),
            "--pin-ttl-s",
            str(PIN_TTL_S),
            "--worker-allow",
            f"127.0.0.1:{ALLOWED_PORT},10.1.2.*:50061",
        ],
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def stub(cell):
    with grpc.insecure_channel(cell.address) as channel:
        yield serving_pb2_grpc.SchedulerStub(channel)


def key(name: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {name}"),)


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def generate(stub, **fields) -> list[serving_pb2.GenerateResponse]:
    request = serving_pb2.GenerateRequest(prompt_token_ids=[5, 17, 99, 123], max_tokens=8, temperature=0.0, **fields)
    return list(stub.Generate(request, metadata=key(KEY_A), timeout=WAIT_S))


# ---- 1 and 7: the grammar path --------------------------------------------------------------


def test_the_grammar_that_crashed_the_scheduler_is_refused_and_streams_go_on(cell, stub):
    running = serving_pb2.GenerateRequest(prompt_token_ids=[7, 8, 9], max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = stub.Generate(running, metadata=key(KEY_B), timeout=WAIT_S)
    first = next(stream)  # running before the repro arrives
    for _ in range(3):  # the launcher gave up after five deaths; each of these ends a sandbox child
        err = refusal(lambda: generate(stub, grammar=rule_chain(3000)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == "structured_output.grammar: the grammar crashed the grammar compiler (SIGSEGV)"
    rest = list(stream)
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 200 and rest[-1].finished
    assert cell.scheduler.proc.poll() is None
    # The scheduler compiles and serves constraints as before.
    out = generate(stub, regex="[a-c]{3}")
    assert out[-1].finish_reason == "stop" and out[-1].usage.completion_tokens == 3, out
    # (random prompt ids end mid-character: the first token's text carries their tail)
    assert "".join(r.text for r in out)[-3:] in {a + b + c for a in "abc" for b in "abc" for c in "abc"}, out


def test_a_grammar_past_the_rule_limit_is_refused_naming_the_flag(stub):
    err = refusal(lambda: generate(stub, grammar=rule_chain(7000)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "structured_output.grammar: 7002 rules, over the limit of 6000 (--max-grammar-rules)"


@pytest.mark.parametrize(
    ("fields", "details"),
    [
        (
            {"json_schema": nested_schema(10_000)},
            "structured_output.json_schema: nested too deeply to parse",
        ),
        (
            {"json_schema": nested_schema(100)},
            "structured_output.json_schema: nested 201 levels deep, over the limit of 64 (--max-grammar-depth)",
        ),
        (
            {"choice": serving_pb2.ChoiceList(choices=["yes", "n\x01o"])},
            "structured_output.choice: choice 1 holds the control character '\\x01'",
        ),
    ],
)
def test_deep_schemas_and_control_characters_are_refused_by_field(stub, fields, details):
    err = refusal(lambda: generate(stub, **fields))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)


# ---- 4: the internal token stays with trusted workers --------------------------------------


def test_add_worker_to_an_untrusted_address_is_refused_and_no_token_leaves(cell):
    trap, allowed = TrapListener(), TrapListener(ALLOWED_PORT)
    token = cell.secrets.internal_token_file.read_text().strip()
    try:
        with grpc.insecure_channel(cell.scheduler.admin_address) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            add = admin.AddWorker
            err = refusal(
                lambda: add(admin_pb2.AddWorkerRequest(address=trap.address), metadata=cell.admin_metadata, timeout=30)
            )
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"worker {trap.address} is not one the scheduler trusts" in err.details()
            assert "--worker-allow" in err.details()
            # The control: an address --worker-allow names is trusted, and it gets the token
            # (it is no worker, so the add then fails): the trap would have seen one.
            err = refusal(
                lambda: add(
                    admin_pb2.AddWorkerRequest(address=allowed.address), metadata=cell.admin_metadata, timeout=60
                )
            )
            assert err.code() != grpc.StatusCode.PERMISSION_DENIED
            listed = admin.ListWorkers(admin_pb2.ListWorkersRequest(), metadata=cell.admin_metadata, timeout=10)
        assert [w.address for w in listed.workers] == [cell.workers[0].address]
        assert trap.calls == []
        assert allowed.calls and all(c.get("authorization") == f"Bearer {token}" for c in allowed.calls)
    finally:
        trap.stop()
        allowed.stop()


# ---- 8: pins per key --------------------------------------------------------------------------


def pin(stub, who: str, ids: list[int]) -> serving_pb2.PinPrefixResponse:
    return stub.PinPrefix(serving_pb2.PinPrefixRequest(prompt_token_ids=ids), metadata=key(who), timeout=WAIT_S)


def pinned_blocks(stub) -> int:
    return stub.Stats(serving_pb2.StatsRequest(), metadata=key(KEY_A), timeout=10).blocks_pinned


def test_a_key_pins_at_most_its_share_only_it_unpins_and_pins_expire(stub):
    a1 = pin(stub, KEY_A, list(range(100, 196)))  # 96 tokens: 6 blocks of 16
    assert a1.pinned_tokens == 96 and pinned_blocks(stub) == 6
    err = refusal(lambda: pin(stub, KEY_A, list(range(300, 348))))  # 3 more: 9 > 8
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over its share 0.125 = 8 (--max-pin-share-per-key)" in err.details()
    assert pinned_blocks(stub) == 6  # the refused pin was dropped again
    assert pin(stub, KEY_A, list(range(100, 196))).pin_id == a1.pin_id  # pinning again renews, costs nothing
    b1 = pin(stub, KEY_B, list(range(300, 348)))  # B has a share of its own
    assert pinned_blocks(stub) == 9
    # B cannot unpin A's pin; A can unpin its own once.
    assert not stub.UnpinPrefix(serving_pb2.UnpinPrefixRequest(pin_id=a1.pin_id), metadata=key(KEY_B)).unpinned
    assert pinned_blocks(stub) == 9
    assert stub.UnpinPrefix(serving_pb2.UnpinPrefixRequest(pin_id=a1.pin_id), metadata=key(KEY_A)).unpinned
    assert pinned_blocks(stub) == 3
    # B's pin lapses after its TTL without anyone asking.
    deadline = time.monotonic() + PIN_TTL_S + 5
    while pinned_blocks(stub) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pinned_blocks(stub) == 0
    assert not stub.UnpinPrefix(serving_pb2.UnpinPrefixRequest(pin_id=b1.pin_id), metadata=key(KEY_B)).unpinned
