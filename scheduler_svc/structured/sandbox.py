"""Where a grammar is first compiled: a child process, so that a compiler crash
(llguidance overflowing its native stack on a deep grammar, or running out of
memory) ends that child, never the scheduler that serves everyone.

A child (sandbox_child.py) holds the vocabulary, compiles a constraint exactly as
the scheduler would (build_matcher, first mask included) on a thread with half the
stack the scheduler's compile threads have, under an address-space limit, and
answers whether it compiled. Only a constraint that compiled there is compiled
again in the scheduler (the matcher cannot cross processes), so the cold compile
costs about twice; the compiled-grammar cache keeps the warm path in-process. A
child that dies or outlasts the time limit is killed and replaced; the constraint
is refused naming the field."""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from scheduler_svc.structured.constraint import Constraint
from scheduler_svc.structured.errors import ConstraintRejected

log = structlog.get_logger(__name__)

DEFAULT_MEMORY_MB = 2048
START_TIMEOUT_S = 120.0  # importing llguidance and building the vocabulary: ~1-2 s, slower on a busy machine
_FALLBACK_THREAD_STACK = 2 << 20  # glibc's thread stack when RLIMIT_STACK is unlimited (x86-64)
_MAX_CHILD_STACK = 4 << 20
_REPO_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class SandboxVocab:
    """What a child needs to build the scheduler's GrammarVocab."""

    tokenizer_json: str
    logits_width: int
    eos_token_ids: tuple[int, ...]


def child_stack_bytes() -> int:
    """Half the stack a compile thread of this process gets: a grammar that compiled in the
    child has that margin when compiled again here (stack use per nesting level is fixed)."""
    size = threading.stack_size()
    if size == 0:
        soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
        size = soft if soft != resource.RLIM_INFINITY else _FALLBACK_THREAD_STACK
    return min(size // 2, _MAX_CHILD_STACK)


class _Child:
    def __init__(self, vocab: SandboxVocab, memory_mb: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler_svc.structured.sandbox_child", str(child_stack_bytes())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buffer = b""
        self.send(
            {
                "tokenizer_json": vocab.tokenizer_json,
                "logits_width": vocab.logits_width,
                "eos_token_ids": list(vocab.eos_token_ids),
                "memory_mb": memory_mb,
            }
        )
        self.ready = False

    def wait_ready(self) -> None:
        """Started apart from spawning: the vocabulary builds here while the child builds its own."""
        if not self.ready and self.receive(time.monotonic() + START_TIMEOUT_S) != {"ready": True}:
            self.kill()
            raise RuntimeError(f"the grammar compile sandbox did not start (exit {self.proc.poll()})")
        self.ready = True

    def send(self, message: dict[str, object]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> dict[str, object] | None:
        """The child's next answer; None if it died or did not answer by `deadline`
        (time.monotonic()), also when one is there but this thread got to it late."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0] or time.monotonic() > deadline:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None  # EOF: the child died
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer: dict[str, object] = json.loads(line)
        return answer

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class CompileSandbox:
    """Child processes that try each new constraint first. Thread-safe: each caller
    thread takes an idle child (or starts one) for the length of its check."""

    def __init__(self, vocab: SandboxVocab, timeout_s: float, memory_mb: int = DEFAULT_MEMORY_MB) -> None:
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._idle = [_Child(vocab, memory_mb)]  # starting now: the first constraint does not wait for it
        self._lock = threading.Lock()
        self._closed = False
        self.crashes = 0  # children lost to a constraint (killed, crashed, timed out)

    def check(self, constraint: Constraint) -> None:
        """Returns if `constraint` compiled in a child; ConstraintRejected otherwise."""
        child = self._take()
        # Timed from before the send: a thread descheduled between sending and waiting
        # must not find a late answer already there and call it in time.
        deadline = time.monotonic() + self.timeout_s
        try:
            child.send(
                {
                    "kind": constraint.kind,
                    "text": constraint.text,
                    "choices": list(constraint.choices),
                    "strict": constraint.strict,
                }
            )
            answer = child.receive(deadline)
        except (BrokenPipeError, OSError):
            answer = None
        if answer is None:
            child.kill()
            self.crashes += 1
            code = child.proc.returncode
            # kill() itself ends with -SIGKILL: the child was alive, i.e. it ran out of time
            why = (
                f"took longer than {self.timeout_s:g} s to compile"
                if code == -signal.SIGKILL
                else f"crashed the grammar compiler ({_exit_text(code)})"
            )
            log.warning("grammar compile refused", field=constraint.field, reason=why, chars=len(constraint.text))
            raise ConstraintRejected(constraint.field, f"the grammar {why}")
        self._give_back(child)
        if "error" in answer:
            raise ConstraintRejected(constraint.field, str(answer["error"]))

    def wait_ready(self) -> None:
        """Block until a child is up (its start-up is not any constraint's compile time)."""
        self._give_back(self._take())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()

    def _take(self) -> _Child:
        with self._lock:
            child = self._idle.pop() if self._idle else None
        child = child or _Child(self.vocab, self.memory_mb)
        child.wait_ready()
        return child

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(child)
                return
        child.kill()


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return f"exit {code}"
