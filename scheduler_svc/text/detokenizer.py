"""Incremental detokenization with stop strings.

Tokens arrive one at a time; text is released only when it is final:
* a byte-level BPE token can end mid UTF-8 character, so text that ends in the
  replacement character is held until the next token completes it;
* the last `max(len(stop)) - 1` characters are held back while a stop string
  could still be completing, because stop strings are not part of the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.text.tokenizer import ModelTokenizer

# Decoding restarts a few tokens back so byte-level pieces have their context.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: ModelTokenizer
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # all decoded text so far, stop string excluded
    emitted: int = 0  # characters of `text` already released
    stopped: bool = False
    _prefix_offset: int = 0
    _read_offset: int = 0

    @classmethod
    def for_prompt(
        cls, tokenizer: ModelTokenizer, prompt_ids: list[int], stop: tuple[str, ...]
    ) -> IncrementalDetokenizer:
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        return cls(tokenizer, tuple(s for s in stop if s), context, _prefix_offset=0, _read_offset=len(context))

    def add(self, token_id: int) -> str:
        """Append one token; returns newly final text (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self._check_stop()
        return self._release()

    def flush(self) -> str:
        """At the end of the stream: release everything still held back."""
        self.emitted, tail = len(self.text), self.text[self.emitted :]
        return tail

    def _check_stop(self) -> None:
        for stop in self.stop:
            # Only the new text (plus a stop's length of overlap) can hold a new match.
            start = max(0, self.emitted - len(stop))
            at = self.text.find(stop, start)
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True

    def _release(self) -> str:
        if self.stopped:
            return self.flush()
        hold = max((len(s) for s in self.stop), default=1) - 1
        end = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
