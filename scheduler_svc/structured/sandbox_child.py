"""The compile sandbox's child process (sandbox.py starts it with its thread
stack in bytes as argv): one JSON line in (the vocabulary, the memory limit),
then per line a constraint in and {} or {"error"} out. It compiles on one
thread whose stack and address space are bounded, so a deep grammar crashes
here, where the parent sees EOF and refuses it."""

from __future__ import annotations

import json
import resource
import sys
import threading
from typing import Any

from scheduler_svc.structured.compiler import build_matcher
from scheduler_svc.structured.constraint import Constraint, ConstraintKind
from scheduler_svc.structured.errors import ConstraintRejected
from scheduler_svc.structured.vocab import GrammarVocab


def _serve() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    init = json.loads(stdin.readline())
    vocab = GrammarVocab(init["tokenizer_json"], init["logits_width"], init["eos_token_ids"])
    # After the vocabulary is built: the limit bounds what a grammar adds to it.
    memory = init["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    stdout.write(b'{"ready": true}\n')
    stdout.flush()
    for line in stdin:
        stdout.write(json.dumps(_try(vocab, json.loads(line))).encode() + b"\n")
        stdout.flush()


def _try(vocab: GrammarVocab, message: dict[str, Any]) -> dict[str, str]:
    constraint = Constraint(
        ConstraintKind(message["kind"]), message["text"], tuple(message["choices"]), message["strict"]
    )
    try:
        build_matcher(vocab, constraint)
    except ConstraintRejected as exc:
        return {"error": exc.message}
    except (ValueError, RecursionError, MemoryError) as exc:
        return {"error": f"does not compile: {type(exc).__name__}"}
    return {}


def main() -> None:
    threading.stack_size(int(sys.argv[1]))  # before the compile thread starts: argv, not the init line
    worker = threading.Thread(target=_serve, name="sandboxed-compile")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
