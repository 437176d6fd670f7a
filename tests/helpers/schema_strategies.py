"""Hypothesis strategies for JSON schemas of the kinds structured outputs see:
nested objects, arrays with bounds, enums, numbers with ranges, required and
optional properties; shared by the grammar-walk and end-to-end tests."""

from __future__ import annotations

from hypothesis import strategies as st

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
# Assigned characters only: a byte-level vocabulary may lack the lead bytes of unassigned
# planes (SmolLM2 has no 0xF1): test_structured_schemas.py, test_a_character_the_vocabulary_cannot_spell.
ENUM_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Cn", "Co")), min_size=1, max_size=6)


@st.composite
def integers(draw):
    low = draw(st.integers(-5000, 5000))
    return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 3000))}


@st.composite
def numbers(draw):
    low = draw(st.floats(-1000, 1000, allow_nan=False).map(lambda x: round(x, 2)))
    schema = {"type": "number", "minimum": low, "maximum": low + draw(st.sampled_from([0.5, 1, 10, 250]))}
    if draw(st.booleans()) and not (low >= 0 and low.is_integer()):  # test_structured_schemas.py: llguidance bug
        schema["exclusiveMinimum"] = schema.pop("minimum")
    return schema


@st.composite
def strings(draw):
    high = draw(st.integers(1, 10))
    return {"type": "string", "minLength": draw(st.integers(0, high)), "maxLength": high}


LEAVES = st.one_of(
    integers(),
    numbers(),
    strings(),
    st.lists(ENUM_TEXT, min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "string", "pattern": "^[a-z]{1,4}-[0-9]{2}$"}]),
)


@st.composite
def objects(draw, children):
    properties = draw(st.dictionaries(NAMES, children, min_size=1, max_size=4))
    required = [name for name in properties if draw(st.booleans())]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@st.composite
def arrays(draw, children):
    low = draw(st.integers(0, 2))
    return {"type": "array", "items": draw(children), "minItems": low, "maxItems": low + draw(st.integers(0, 3))}


def extend(children):
    return st.one_of(objects(children), arrays(children))


SCHEMAS = objects(st.recursive(LEAVES, extend, max_leaves=6))
