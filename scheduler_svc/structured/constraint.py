"""A request's structured-output constraint: what its output must match.
Plain, hashable data (the compiled-grammar cache key); checked for shape when
built, compiled by compiler.py."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from scheduler_svc.structured.errors import ConstraintRejected

MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar (the gRPC message limit is larger)
MAX_CHOICES = 1024
_ALLOWED_CONTROLS = frozenset("\t\n\r")  # whitespace a tokenizer spells; other Cc characters are refused


class ConstraintKind(StrEnum):
    """serving.v1's `structured_output` oneof: each name is also the field named in errors."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # Lark (llguidance's dialect) or GBNF/EBNF as llama.cpp writes it


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    text: str = ""  # the schema as canonical JSON, the regex, or the grammar
    choices: tuple[str, ...] = ()
    # json_schema only: keywords the engine does not implement are an error
    # (strict) or ignored (not strict, OpenAI's best-effort `strict: false`).
    strict: bool = True

    @property
    def field(self) -> str:
        return f"structured_output.{self.kind}"

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, strict: bool = True) -> Constraint:
        field = f"structured_output.{ConstraintKind.JSON_SCHEMA}"
        if isinstance(schema, str):
            _check_size(field, schema)
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintRejected(field, f"not valid JSON: {exc}") from None
            except RecursionError:  # limits.py bounds the depth a compile may see; this is parsing's own bound
                raise ConstraintRejected(field, "nested too deeply to parse") from None
        if not isinstance(schema, Mapping):
            raise ConstraintRejected(field, f"a schema is a JSON object, got {type(schema).__name__}")
        # Compact text: the same schema spaced two ways shares one compiled grammar. Keys
        # keep their order: properties are generated in the order the schema lists them.
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except RecursionError:
            raise ConstraintRejected(field, "nested too deeply to parse") from None
        _check_size(field, text)
        return cls(ConstraintKind.JSON_SCHEMA, text, strict=strict)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        _check_size(f"structured_output.{ConstraintKind.REGEX}", pattern)
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def choice(cls, options: Iterable[str]) -> Constraint:
        field = f"structured_output.{ConstraintKind.CHOICE}"
        choices = tuple(options)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise ConstraintRejected(field, f"1 to {MAX_CHOICES} choices, got {len(choices)}")
        if not all(isinstance(c, str) and c for c in choices):
            raise ConstraintRejected(field, "every choice is a non-empty string")
        for index, choice in enumerate(choices):
            # No token spells most control characters: such a choice would be accepted, then fail mid-output.
            if bad := next(
                (ch for ch in choice if ch not in _ALLOWED_CONTROLS and unicodedata.category(ch) == "Cc"), None
            ):
                raise ConstraintRejected(field, f"choice {index} holds the control character {bad!r}")
        _check_size(field, "".join(choices))
        return cls(ConstraintKind.CHOICE, choices=choices)

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        field = f"structured_output.{ConstraintKind.GRAMMAR}"
        if not text.strip():
            raise ConstraintRejected(field, "the grammar is empty")
        _check_size(field, text)
        return cls(ConstraintKind.GRAMMAR, text)


def _check_size(field: str, text: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ConstraintRejected(field, f"at most {MAX_CONSTRAINT_CHARS} characters, got {len(text)}")
