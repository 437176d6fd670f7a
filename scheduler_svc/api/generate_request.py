"""A serving.v1 GenerateRequest into the engine's Request: its sampling options, its
output limit, its samples (n), its LoRA adapter and its structured-output matcher.
Each check raises RequestRejected (or ConstraintRejected) naming the field; the servicer
(serving.py) turns those into gRPC status codes."""

from __future__ import annotations

import dataclasses
import uuid

from proto import serving_pb2
from scheduler_svc.engine.engine import Engine
from scheduler_svc.lora.errors import LoraRejected
from scheduler_svc.planning.validation import (
    SEED_SPACE,
    RequestRejected,
    check_constrained,
    check_num_samples,
    check_sampling,
    check_sampling_token_ids,
    default_output_limit,
    output_limit,
)
from scheduler_svc.request import LoraRef, Request, SamplingOptions
from scheduler_svc.structured.constraint import Constraint, ConstraintKind
from scheduler_svc.structured.errors import ConstraintRejected


def request_from_proto(
    msg: serving_pb2.GenerateRequest, engine: Engine, default_max_tokens: int, prompt_ids: list[int]
) -> Request:
    """Validate and convert (the prompt already tokenized: prompt_from_proto); raises
    RequestRejected naming the field. With n > 1, returns a prefill-only parent whose
    children are the n samples."""
    requested = msg.max_tokens if msg.HasField("max_tokens") else None
    asked_default = msg.default_max_tokens if msg.HasField("default_max_tokens") else None
    default = default_output_limit(default_max_tokens, asked_default)
    max_tokens = output_limit(requested, len(prompt_ids), engine.max_model_len, default)
    sampling = _sampling_from_proto(msg, max_tokens)
    check_sampling_token_ids(sampling, engine.tokenizer.vocab_size)
    n = msg.n if msg.HasField("n") else 1
    check_num_samples(n, len(prompt_ids), sampling)
    request_id = msg.request_id or uuid.uuid4().hex
    eos, salt, priority = engine.tokenizer.eos_token_ids, msg.cache_salt or None, msg.priority
    lora = _lora_from_proto(msg.lora_adapter, engine)
    if n == 1:
        return Request(
            request_id,
            engine.requests.next_seq_id(),
            prompt_ids,
            sampling,
            eos_token_ids=eos,
            cache_salt=salt,
            no_speculation=msg.no_speculation,
            priority=priority,
            lora=lora,
        )
    children = [
        Request(
            f"{request_id}/{i}",
            engine.requests.next_seq_id(),
            prompt_ids,
            _sample_seed(sampling, i),
            sample_index=i,
            eos_token_ids=eos,
            cache_salt=salt,
            no_speculation=msg.no_speculation,
            priority=priority,
            lora=lora,
        )
        for i in range(n)
    ]
    return Request(
        request_id,
        engine.requests.next_seq_id(),
        prompt_ids[:-1],
        sampling,
        prefill_only=True,
        children=children,
        eos_token_ids=eos,
        cache_salt=salt,
        priority=priority,
        lora=lora,
    )


def _lora_from_proto(name: str, engine: Engine) -> LoraRef | None:
    """The request's adapter (empty: the base model); RequestRejected naming lora_adapter."""
    if not name:
        return None
    if engine.fleet.lora is None:
        raise RequestRejected("lora_adapter", "this scheduler serves no LoRA adapters (start it with --enable-lora)")
    try:
        return engine.fleet.lora.resolve(name)
    except LoraRejected as exc:
        raise RequestRejected(exc.field, exc.message) from None


def constraint_from_proto(msg: serving_pb2.GenerateRequest) -> Constraint | None:
    """The request's structured_output, or None; ConstraintRejected / RequestRejected naming the field."""
    kind = msg.WhichOneof("structured_output")
    if msg.HasField("json_schema_strict") and kind != ConstraintKind.JSON_SCHEMA:
        raise RequestRejected("json_schema_strict", "only with structured_output json_schema")
    if kind is None:
        if msg.structured_output_after:
            raise RequestRejected("structured_output_after", "only with a structured_output constraint")
        return None
    match ConstraintKind(kind):
        case ConstraintKind.JSON_SCHEMA:
            strict = msg.json_schema_strict if msg.HasField("json_schema_strict") else True
            return Constraint.json_schema(msg.json_schema, strict=strict)
        case ConstraintKind.JSON_OBJECT:
            if not msg.json_object:
                raise ConstraintRejected("structured_output.json_object", "true, or leave the constraint out")
            return Constraint.json_object()
        case ConstraintKind.REGEX:
            return Constraint.regex(msg.regex)
        case ConstraintKind.CHOICE:
            return Constraint.choice(msg.choice.choices)
        case ConstraintKind.GRAMMAR:
            return Constraint.grammar(msg.grammar)


async def attach_grammar(request: Request, msg: serving_pb2.GenerateRequest, engine: Engine) -> None:
    """Compile the request's constraint (before it takes a queue slot: a bad grammar is
    INVALID_ARGUMENT) and give each of its samples a matcher of its own."""
    constraint = constraint_from_proto(msg)
    if constraint is None:
        return
    check_constrained(request.sampling)
    grammar = await engine.grammars.compile(constraint)
    for sample in request.children or [request]:
        sample.grammar = engine.grammars.matcher(grammar, msg.structured_output_after)


def _sample_seed(sampling: SamplingOptions, index: int) -> SamplingOptions:
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % SEED_SPACE)


def _sampling_from_proto(msg: serving_pb2.GenerateRequest, max_tokens: int) -> SamplingOptions:
    sampling = SamplingOptions(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=max_tokens,
        stop=tuple(s for s in msg.stop if s),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
    )
    check_sampling(sampling)
    return sampling
