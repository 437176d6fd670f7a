"""The commands the documentation prints, as the docs test runs them: the fenced
shell and python blocks of a Markdown page (each with the output block shown
right after it, if any), the examples of `make serve`'s banner, and the check
that an output has the structure of the one shown.

An output shown is compared by structure, not by the model's words: JSON (the
whole output) by its keys and value types, text line by line, where `…` stands
for any text within a line and a line of `…` alone for any number of lines."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
ELLIPSIS = "…"
_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the block's fence, or the banner example's comment
    language: str  # "bash" or "python"
    code: str
    shown: str | None = None  # the output the page shows right after it


def markdown_blocks(text: str, name: str) -> list[Block]:
    """Every runnable fenced block of a page; a ```text block that follows one with
    nothing but blank lines between is its output."""
    fences = list(_FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        language = RUNNABLE.get(fence.group(1))
        if language is None:
            continue
        shown = None
        after = fences[i + 1] if i + 1 < len(fences) else None
        if after is not None and after.group(1) == "text" and not text[fence.end() : after.start()].strip():
            shown = after.group(2)
        line = text.count("\n", 0, fence.start()) + 1
        blocks.append(Block(f"{name}:{line}", language, fence.group(2), shown))
    return blocks


def banner_blocks(banner: str, start: str, end: str) -> list[Block]:
    """The banner's examples between the line starting with `start` and the one starting
    with `end`: paragraphs that open with a `# what it does` comment and paste as is."""
    lines = banner.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next(i for i, line in enumerate(lines) if line.startswith(end))
    paragraphs = "\n".join(lines[first + 1 : last]).strip().split("\n\n")
    return [Block(f"banner: {p.splitlines()[0]}", "bash", p + "\n") for p in paragraphs if p.startswith("# ")]


def mismatch(shown: str, actual: str) -> str | None:
    """None when `actual` has the structure of `shown`, else what differs."""
    expected = _json(shown)
    if expected is not _NOT_JSON:
        got = _json(actual)
        if got is _NOT_JSON:
            return f"JSON shown, got:\n{actual}"
        return _shape(expected, got, "$")
    if _lines_match(shown.strip("\n").splitlines(), actual.strip("\n").splitlines()):
        return None
    return f"shown:\n{shown}\ngot:\n{actual}"


_NOT_JSON = object()


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    return {int: "number", float: "number", str: "string", list: "list", dict: "object"}[type(value)]


def _shape(expected: Any, got: Any, path: str) -> str | None:
    if _kind(expected) != _kind(got):
        return f"{path}: a {_kind(expected)} shown, got {got!r}"
    if isinstance(expected, dict):
        if expected.keys() != got.keys():
            return f"{path}: keys {sorted(expected)} shown, got {sorted(got)}"
        return next((m for k in expected if (m := _shape(expected[k], got[k], f"{path}.{k}"))), None)
    if isinstance(expected, list) and expected:
        if not got:
            return f"{path}: items shown, got an empty list"
        return next((m for i, item in enumerate(got) if (m := _shape(expected[0], item, f"{path}[{i}]"))), None)
    return None


def _lines_match(shown: list[str], actual: list[str]) -> bool:
    """Line patterns against lines; a line of `…` alone takes any number of lines."""
    if not shown:
        return not actual
    if shown[0].strip() == ELLIPSIS:
        return any(_lines_match(shown[1:], actual[i:]) for i in range(len(actual) + 1))
    if not actual:
        return False
    pattern = ".*".join(re.escape(part) for part in shown[0].split(ELLIPSIS))
    return re.fullmatch(pattern, actual[0]) is not None and _lines_match(shown[1:], actual[1:])
