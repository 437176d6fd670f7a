"""Incremental detokenization with stop strings.

Tokens arrive one at a time; text is released only when it is final:
* a byte-level BPE token can end mid UTF-8 character: the tokenizers library's
  DecodeStream holds such bytes until a later token completes the character
  (one Rust call per token, seeded with the prompt's last tokens so that the
  first output token decodes in context, e.g. its leading space);
* the last `max(len(stop)) - 1` characters are held back while a stop string
  could still be completing, because stop strings are not part of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from scheduler_svc.text.tokenizer import ModelTokenizer

# The prompt's last tokens seed the stream so that byte-level pieces have their context.
_CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: ModelTokenizer
    stream: DecodeStream
    stop: tuple[str, ...] = ()
    text: str = ""  # with stop strings: all decoded text so far, the stop string excluded
    emitted: int = 0  # characters of `text` already released
    matched: str | None = None  # the stop string that ended the text (the earliest found)

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @classmethod
    def for_prompt(
        cls, tokenizer: ModelTokenizer, prompt_ids: list[int], stop: tuple[str, ...]
    ) -> IncrementalDetokenizer:
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        stream = DecodeStream(context, skip_special_tokens=True)
        return cls(tokenizer, stream, tuple(s for s in stop if s))

    def add(self, token_id: int) -> str:
        """Append one token; returns newly final text (may be empty)."""
        if self.stopped:
            return ""
        piece = self.stream.step(self.tokenizer.tokenizer, token_id)
        if not self.stop:  # nothing to hold back or search: the piece is final as it comes
            return piece or ""
        if piece:
            self.text += piece
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
            if at >= 0:  # a later stop found here starts earlier in the text: the cut is the earliest
                self.text = self.text[:at]
                self.matched = stop

    def _release(self) -> str:
        if self.stopped:
            return self.flush()
        hold = max((len(s) for s in self.stop), default=1) - 1
        end = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
