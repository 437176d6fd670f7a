"""An incremental scanner of one tool call's JSON body, `{"name": ..., "arguments": ...}`,
fed text in any pieces: it tells the function's name as soon as its string
closes and hands out the arguments' raw JSON text as it arrives (the tool-call
parsers stream them as OpenAI does). Keys may come in any order; other keys
are skipped. Text that is not such an object ends the scan as `failed`."""

from __future__ import annotations

import json

WHITESPACE = " \t\r\n"
NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/OpenAI; Llama 3's JSON format


class _Value:
    """Where one JSON value ends: strings, objects and arrays at their closing
    character, numbers and literals before the first character past them."""

    def __init__(self, first: str) -> None:
        self.kind = first
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def takes(self, char: str) -> bool:
        """Whether `char` belongs to the value (False: the value ended before it)."""
        if self.kind not in '{["':  # number, true, false, null
            if char in ",}]" + WHITESPACE:
                self.done = True
                return False
            return True
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                self.done = self.depth == 0
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


class CallBodyScanner:
    def __init__(self) -> None:
        self.text = ""  # everything taken so far
        self.name: str | None = None
        self.announced = False  # the parser has sent the name
        self.done = False
        self.failed = False
        self._state = "start"
        self._key = ""
        self._key_raw: list[str] = []
        self._key_escaped = False
        self._value: _Value | None = None
        self._value_raw: list[str] = []
        self._arguments: list[str] = []  # raw argument text not yet taken

    def feed(self, text: str) -> int:
        """Scan `text`; returns how many characters belong to the body (all, until it ends)."""
        for i, char in enumerate(text):
            if self.done:
                self.text += text[:i]
                return i
            self._step(char)
        self.text += text
        return len(text)

    def take_arguments(self) -> str:
        taken = "".join(self._arguments)
        self._arguments = []
        return taken

    def _step(self, char: str) -> None:
        state = self._state
        if state == "value":
            assert self._value is not None
            if self._value.takes(char):
                self._value_char(char)
                if self._value.done:
                    self._end_value()
                return
            self._end_value()
            state = self._state  # the character is the object's again
        if state == "key":
            self._key_char(char)
        elif char in WHITESPACE:
            return
        elif state == "start":
            self._expect(char == "{", "key_or_end")
        elif state == "key_or_end" and char == "}":
            self.done = True
        elif state in ("key_or_end", "key_next"):
            self._expect(char == '"', "key")
            self._key_raw, self._key_escaped = [], False
        elif state == "colon":
            self._expect(char == ":", "value_start")
        elif state == "value_start":
            self._start_value(char)
        elif state == "after_value":
            if char == "}":
                self.done = True
            else:
                self._expect(char == ",", "key_next")

    def _expect(self, ok: bool, next_state: str) -> None:
        if ok:
            self._state = next_state
        else:
            self.failed = self.done = True

    def _key_char(self, char: str) -> None:
        if self._key_escaped:
            self._key_escaped = False
        elif char == "\\":
            self._key_escaped = True
        elif char == '"':
            self._key = json.loads('"' + "".join(self._key_raw) + '"')
            self._state = "colon"
            return
        self._key_raw.append(char)

    def _start_value(self, char: str) -> None:
        self._value = _Value(char)
        self._value_raw = []
        self._state = "value"
        self._value.takes(char)
        self._value_char(char)
        if self._value.done:
            self._end_value()

    def _value_char(self, char: str) -> None:
        self._value_raw.append(char)
        # Object arguments stream as they come; a string (arguments JSON-encoded in a string) waits for its end.
        if self._key in ARGUMENT_KEYS and self._value is not None and self._value.kind != '"':
            self._arguments.append(char)

    def _end_value(self) -> None:
        assert self._value is not None
        raw = "".join(self._value_raw)
        if self._key == NAME_KEY and self._value.kind == '"':
            self.name = json.loads(raw)
        elif self._key in ARGUMENT_KEYS and self._value.kind == '"':
            self._arguments.append(json.loads(raw))
        self._value = None
        self._state = "after_value"
