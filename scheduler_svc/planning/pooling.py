"""Pooling requests (--runner pooling): what each chunk of a pooling request asks
the worker for, the embedding made of what comes back, and the model's own
pooling config.

The worker keeps no request state, so a prompt computed over several chunks
is pooled here: mean pooling asks every chunk for the sum of its hidden states
and adds them up in float64 (Request.pooled_sum), dividing by the prompt's length
at the end; last-token pooling asks only the chunk that ends the prompt for its
last position. Then the first `dimensions` are kept and the vector normalised,
as sentence-transformers does (truncate, then normalise). A yes/no reranker
(--classifier-from-token) asks the chunk that ends the prompt for the logits
there instead, and scores the prompt by its two tokens'."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from scheduler_svc.planning.plan import RowPooling
from scheduler_svc.planning.validation import RequestRejected
from scheduler_svc.request import PoolingKind, PoolingOptions, Request

# A causal LM with no pooling config of its own: the last token, normalised (vLLM's default).
DEFAULT_POOLING = PoolingOptions(PoolingKind.LAST, normalize=True)


def row_pooling(request: Request, end: int) -> RowPooling:
    """The chunk of `request` ending at `end`'s pooling ask."""
    if request.pooling is None or request.pooling.kind is PoolingKind.CLASSIFY:
        return RowPooling.NONE  # a classifier asks for logits (returns_logits)
    if request.pooling.kind is PoolingKind.MEAN:
        return RowPooling.SUM
    return RowPooling.LAST if end == request.num_tokens else RowPooling.NONE


def returns_logits(request: Request, end: int) -> bool:
    """A classifier's chunk that ends the prompt: its row samples (greedy, the token is
    dropped) for the worker to return the logits of the prompt's last position."""
    pooling = request.pooling
    return pooling is not None and pooling.kind is PoolingKind.CLASSIFY and end == request.num_tokens


def add_chunk(request: Request, start: int, chunk_sum: NDArray[np.float32]) -> None:
    """Mean pooling: a chunk's sum of hidden states. A chunk from position 0 starts the
    sum again (the request was preempted and computes its prompt anew: mean pooling
    reads nothing from the prefix cache)."""
    if start == 0 or request.pooled_sum is None:
        request.pooled_sum = np.zeros(chunk_sum.shape, dtype=np.float64)
    request.pooled_sum += chunk_sum


def pooled_output(
    request: Request, last: NDArray[np.float32] | None, logits: NDArray[np.float32] | None
) -> list[float]:
    """The finished prompt's output: its embedding, or a classifier's [score]."""
    options = request.pooling
    assert options is not None, "the output of a request that does not pool"
    if options.classifier_token_ids is None:
        return embedding(request, last)
    assert logits is not None, "a classifier's prompt ended without its logits"
    no, yes = options.classifier_token_ids
    # softmax([no, yes])[1] == sigmoid(yes - no), as vLLM folds the two lm_head rows into one
    # (is_original_qwen3_reranker); in float64, in the form that cannot overflow.
    margin = float(logits[yes]) - float(logits[no])
    return [1.0 / (1.0 + math.exp(-margin)) if margin >= 0 else math.exp(margin) / (1.0 + math.exp(margin))]


def classifier_pooling(tokens: str, encode: Callable[[str], list[int]]) -> PoolingOptions:
    """--classifier-from-token NO,YES: two tokens of the vocabulary (each one token as the
    tokenizer encodes it, special tokens not added), else refused naming the flag."""
    texts = tokens.split(",")
    if len(texts) != 2 or not all(texts):
        raise ValueError(f"--classifier-from-token: two tokens, NO,YES (e.g. no,yes), got {tokens!r}")
    ids = []
    for text in texts:
        encoded = encode(text)
        if len(encoded) != 1:
            raise ValueError(f"--classifier-from-token: {text!r} is {len(encoded)} tokens, not one, in this vocabulary")
        ids.append(encoded[0])
    return PoolingOptions(PoolingKind.CLASSIFY, normalize=False, classifier_token_ids=(ids[0], ids[1]))


def embedding(request: Request, last: NDArray[np.float32] | None) -> list[float]:
    """The finished prompt's embedding: `last` is the last chunk's vector (last-token pooling)."""
    options = request.pooling
    assert options is not None, "an embedding of a request that does not pool"
    if options.kind is PoolingKind.MEAN:
        assert request.pooled_sum is not None, "mean pooling ended before any chunk"
        vector = request.pooled_sum / request.num_prompt_tokens
    else:
        assert last is not None, "last-token pooling ended without the last position"
        vector = last.astype(np.float64)
    if options.dimensions is not None:
        vector = vector[: options.dimensions]
    if options.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # torch.nn.functional.normalize's eps
    return [float(x) for x in vector.astype(np.float32)]


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise RequestRejected(
            "dimensions", f"must be in [1, {hidden_size}] (the model's hidden size), got {dimensions}"
        )


def model_pooling(model_dir: str) -> PoolingOptions:
    """The checkpoint's own pooling (sentence-transformers' modules.json naming a
    Pooling module, whose config says which mode, and a Normalize module after it),
    else DEFAULT_POOLING. A pooling mode we do not implement is refused by name."""
    root = Path(model_dir)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return DEFAULT_POOLING
    modules = json.loads(modules_file.read_text())
    types = [str(m.get("type", "")) for m in modules]
    pooling = [m for m in modules if str(m.get("type", "")).endswith("Pooling")]
    if not pooling:
        return DEFAULT_POOLING
    config = json.loads((root / str(pooling[0].get("path", "")) / "config.json").read_text())
    modes = {key.removeprefix("pooling_mode_") for key, on in config.items() if key.startswith("pooling_mode_") and on}
    named = {"lasttoken": PoolingKind.LAST, "mean_tokens": PoolingKind.MEAN}
    if len(modes) != 1 or not modes <= set(named):
        raise ValueError(
            f"{modules_file}: pooling modes {sorted(modes) or 'none'} are not served (one of: lasttoken, mean_tokens)"
        )
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{modules_file}: include_prompt false is not served")
    normalize = any(t.endswith("Normalize") for t in types)
    return PoolingOptions(named[modes.pop()], normalize=normalize)
