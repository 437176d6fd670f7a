"""Constraints that reach the grammar compiler's native recursion (issue 35): a
chain of Lark rules, schemas and regexes nested N deep. At ~3,000 rules or
~10,000 schema levels llguidance overflows its stack and kills its process."""

from __future__ import annotations

import json


def rule_chain(rules: int) -> str:
    """`start: r0`, `r0: r1`, ..., `r<rules>: "z"`: the grammar that segfaulted the scheduler."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(rules)) + f'r{rules}: "z"\n'


def nested_schema(levels: int) -> str:
    """An object schema nesting `levels` objects, as JSON text (built without recursion)."""
    opening = '{"type":"object","properties":{"a":' * levels
    return opening + '{"type":"string"}' + '},"required":["a"]}' * levels


def nested_regex(levels: int) -> str:
    return "(" * levels + "a" + ")" * levels


def schema_levels(text: str) -> int:
    """How many objects `nested_schema` nested (a check on the helper itself)."""
    depth = 0
    node = json.loads(text)
    while node.get("type") == "object":
        node, depth = node["properties"]["a"], depth + 1
    return depth
