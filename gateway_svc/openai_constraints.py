"""Structured outputs in a request body: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` names, each read as one
`OutputConstraint` (gateway_svc/structured.py turns it into serving.v1's fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from gateway_svc.openai_fields import STRICT, Text


@dataclass(frozen=True)
class OutputConstraint:
    """What the output must match, as serving.v1's structured_output names it, and the request
    field it came from (named in errors)."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    value: Any  # the schema (an object, or JSON text), the regex, the choices, the grammar; True for json_object
    field: str
    strict: bool | None = None  # json_schema: None = serving.v1's default (strict)


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema (OpenAI)."""

    model_config = STRICT
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def constraint(self) -> OutputConstraint | None:
        if self.type == "json_object":
            return OutputConstraint("json_object", True, "response_format")
        if self.json_schema is not None:
            schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
            # OpenAI's strict defaults to false: keywords the engine does not implement are ignored then.
            return OutputConstraint("json_schema", schema, "response_format", bool(self.json_schema.strict))
        return None


JsonSchema = dict[str, Any] | Text  # an object, or its JSON text (vLLM takes both)
Choices = Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra body field: exactly one constraint. Its other options
    (structural_tag, disable_any_whitespace, whitespace_pattern, ...) are refused as unknown."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: JsonSchema | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Choices | None = None
    grammar: Text | None = None
    json_object: bool | None = None

    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in self.KINDS if self._value(name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(self.KINDS)} (got {given or 'none'})")
        if self.json_object is False:
            raise ValueError("json_object: true, or leave it out")
        return self

    def _value(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)

    def constraint(self) -> OutputConstraint:
        name = next(n for n in self.KINDS if self._value(n) is not None)
        kind = "json_schema" if name == "json" else name
        return OutputConstraint(kind, self._value(name), f"structured_outputs.{name}")  # type: ignore[arg-type]


# vLLM's older names for the same constraints: guided field -> serving.v1's kind.
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
