"""Tags in streamed text: the tool-call and reasoning parsers hold back the end
of a delta that may be the start of a tag still arriving."""

from __future__ import annotations


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
