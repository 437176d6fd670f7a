"""Embeddings and embedding-cosine scoring, on a scheduler started with --runner
pooling (serving.v1 Embed: one prefill-only request per input, through the
same steps as generation).

    POST /v1/embeddings {model?, input, encoding_format?, dimensions?, user?}
        input: a string, a list of strings, a token-id array or a list of them
        -> {object: list, data: [{object: embedding, index, embedding}], model, usage}
    POST /v1/score  {model?, text_1, text_2}          (vLLM: 1 x N, N x N pairs)
    POST /v1/rerank {model?, query, documents, top_n?, return_documents?}  (Cohere / Jina shape)
        scores are the cosine of the two texts' embeddings; on a yes/no reranker (a scheduler
        with --classifier-from-token, which ModelInfo names) the score of the pair's prompt
        instead: --chat-template rendered over [{role: query}, {role: document}] (vLLM's score
        template), else the two texts end to end, as a pair tokenizes without a template.

A scheduler that generates answers Embed with FAILED_PRECONDITION: here a 400
saying so, as vLLM refuses embeddings on a generative model.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import grpc
import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from gateway_svc.chat_template import ChatTemplate, ChatTemplateError
from gateway_svc.errors import bad_request
from gateway_svc.openai_fields import STRICT, Text, TokenId
from gateway_svc.openapi import ERROR_RESPONSES
from gateway_svc.scheduler_client import Scheduler

ForwardedKey = Callable[[Request], str | None]
ModelCheck = Callable[[str | None], None]
Prompt = str | list[int]  # one input: text, or token ids

NonEmptyIds = Annotated[list[TokenId], Field(min_length=1)]
Inputs = (
    Text | NonEmptyIds | Annotated[list[Text], Field(min_length=1)] | Annotated[list[NonEmptyIds], Field(min_length=1)]
)


class EmbeddingRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # OpenAI's end-user id: logged by OpenAI, nothing to honour here


class ScoreRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    text_1: Text | Annotated[list[Text], Field(min_length=1)]
    text_2: Text | Annotated[list[Text], Field(min_length=1)]


class RerankRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    query: Text
    documents: Annotated[list[Text], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True


def prompts_of(value: Inputs) -> list[Prompt]:
    """One prompt per input: a lone string or token array is a batch of one."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]  # a str or a list[int], told apart above
    return list(value)  # type: ignore[arg-type]  # a list of str or of list[int]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / max(float(np.linalg.norm(x) * np.linalg.norm(y)), 1e-12))


class Embedder:
    """The batch's embeddings (or a classifier's scores), one Embed call per input, all in
    flight at once."""

    def __init__(self, client: Scheduler, max_prompts: int, score_template: ChatTemplate | None) -> None:
        self.client = client
        self.max_prompts = max_prompts
        self.score_template = score_template

    async def embed(
        self, prompts: list[Prompt], dimensions: int | None, api_key: str | None, field: str
    ) -> tuple[list[list[float]], int]:
        """(the embeddings in input order, prompt tokens); 400 naming `field` for a bad input."""
        replies = await self._replies(prompts, dimensions, api_key, field, False)
        return [list(r.embedding) for r in replies], sum(r.prompt_tokens for r in replies)

    async def scores(
        self, pairs: list[tuple[str, str]], api_key: str | None, field: str
    ) -> tuple[list[float], int] | None:
        """A yes/no reranker's score of each (query, document) pair and the prompt tokens;
        None when the scheduler embeds (the caller scores by cosine)."""
        try:
            info = await self.client.model_info(api_key)
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.UNIMPLEMENTED:  # an older scheduler: it only embeds
                return None
            raise
        if not info.classifier_from_token:
            return None
        replies = await self._replies([self._pair_prompt(*pair) for pair in pairs], None, api_key, field, True)
        return [r.score for r in replies], sum(r.prompt_tokens for r in replies)

    def _pair_prompt(self, query: str, document: str) -> str:
        if self.score_template is None:
            return query + document
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        try:
            return self.score_template.render(messages, add_generation_prompt=False)
        except ChatTemplateError as exc:
            raise bad_request(str(exc)) from exc

    async def _replies(
        self, prompts: list[Prompt], dimensions: int | None, api_key: str | None, field: str, score: bool
    ) -> list[Any]:
        if len(prompts) > self.max_prompts:
            raise bad_request(f"{field}: at most {self.max_prompts} inputs (--max-prompts), got {len(prompts)}", field)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise bad_request(f"{field}[{i}]: must not be empty", field)
        calls = (self._one(p, dimensions, api_key, field, i, score) for i, p in enumerate(prompts))
        return list(await asyncio.gather(*calls))

    async def _one(
        self, prompt: Prompt, dimensions: int | None, api_key: str | None, field: str, index: int, score: bool
    ) -> Any:
        try:
            return await self.client.embed(prompt, dimensions, api_key, score)
        except grpc.aio.AioRpcError as err:
            details = err.details() or ""
            if err.code() is grpc.StatusCode.FAILED_PRECONDITION:
                raise bad_request(f"this model does not serve embeddings: {details}", "model") from err
            if err.code() is grpc.StatusCode.INVALID_ARGUMENT:
                if details.startswith("dimensions"):
                    raise bad_request(details, "dimensions") from err
                raise bad_request(f"{field}[{index}]: {details.removeprefix('prompt: ')}", field) from err
            raise


def embeddings_router(
    client: Scheduler,
    model_id: str,
    forwarded_key: ForwardedKey,
    served: ModelCheck,
    max_prompts: int,
    score_template: ChatTemplate | None = None,
) -> APIRouter:
    """score_template: --chat-template, which a yes/no reranker's pairs are rendered with."""
    router = APIRouter()
    embedder = Embedder(client, max_prompts, score_template)

    @router.post("/v1/embeddings", responses=ERROR_RESPONSES)
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        served(body.model)
        vectors, tokens = await embedder.embed(prompts_of(body.input), body.dimensions, forwarded_key(request), "input")
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        return {"object": "list", "data": data, "model": model_id, "usage": _usage(tokens)}

    @router.post("/v1/score", responses=ERROR_RESPONSES)
    async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
        served(body.model)
        left = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        right = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(left) != 1 and len(left) != len(right):
            raise bad_request(f"text_1: one text or as many as text_2 ({len(right)}), got {len(left)}", "text_1")
        scores, tokens = await _pair_scores(embedder, left, right, forwarded_key(request), "text")
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "model": model_id,
            "data": data,
            "usage": _usage(tokens),
        }

    @router.post("/v1/rerank", responses=ERROR_RESPONSES)
    async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
        served(body.model)
        scores, tokens = await _pair_scores(embedder, [body.query], body.documents, forwarded_key(request), "documents")
        scored = sorted(enumerate(scores), key=lambda pair: -pair[1])
        results = [
            {"index": i, "relevance_score": s}
            | ({"document": {"text": body.documents[i]}} if body.return_documents else {})
            for i, s in scored[: body.top_n or len(scored)]
        ]
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model_id,
            "usage": {"total_tokens": tokens},
            "results": results,
        }

    return router


async def _pair_scores(
    embedder: Embedder, left: list[str], right: list[str], api_key: str | None, field: str
) -> tuple[list[float], int]:
    """The score of each pair (left[0] or left[i], right[i]): a yes/no reranker's, else the
    cosine of the texts' embeddings; and the prompt tokens."""
    pairs = [(left[0] if len(left) == 1 else left[i], text) for i, text in enumerate(right)]
    classified = await embedder.scores(pairs, api_key, field)
    if classified is not None:
        return classified
    vectors, tokens = await embedder.embed([*left, *right], None, api_key, field)
    firsts, seconds = vectors[: len(left)], vectors[len(left) :]
    return [cosine(firsts[0] if len(firsts) == 1 else firsts[i], v) for i, v in enumerate(seconds)], tokens


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """base64: the little-endian float32 bytes, as OpenAI sends them (the client decodes them so)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}
