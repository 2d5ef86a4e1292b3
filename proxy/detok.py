"""Incremental detokenization and stop strings: token ids in, text deltas out.

``IncrementalDetokenizer`` decodes only a short window of recent tokens per step and never hands
out text that ends inside a UTF-8 character: a byte-level BPE token may hold half a character,
which decodes to U+FFFD until the next token completes it. ``OutputText`` adds stop strings: the
text is cut before the first occurrence of any of them, and while streaming, a tail that could be
the beginning of a stop string is held back, so a stop string is never partly sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decode a growing list of output token ids, one stable text delta at a time.

    Window: ``ids[prefix:read]`` is the text handed out last step, ``ids[read:]`` the tokens not
    yet handed out. Decoding ``ids[prefix:]`` and cutting off the old part gives the new text; the
    extra context token(s) keep tokenizers whose pieces depend on the left neighbour right.
    Special tokens (EOS...) decode to nothing.
    """

    def __init__(self, tokenizer: Decoder) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add a token; return the text that became stable (may be empty)."""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def flush(self) -> str:
        """At the end of the output: whatever is left, an incomplete character included."""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


class OutputText:
    """One output's text as its tokens arrive, cut at the first stop string."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._sent = 0  # characters of _text already taken
        self.stopped = False  # a stop string was found; later tokens are ignored

    @property
    def text(self) -> str:
        return self._text

    def add(self, token_id: int) -> None:
        if not self.stopped:
            self._append(self._detok.push(token_id))

    def take(self) -> str:
        """The text that may be sent now: all but a tail that could start a stop string."""
        end = len(self._text) if self.stopped else len(self._text) - self._held_back()
        return self._take_to(end)

    def finish(self) -> str:
        """The rest of the text at the end of the output (nothing held back any more)."""
        if not self.stopped:
            self._append(self._detok.flush())
        return self._take_to(len(self._text))

    def _take_to(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent:end], end
        return out

    def _append(self, delta: str) -> None:
        if not delta:
            return
        # A stop string may straddle the old text and the delta: search from just before the delta.
        start = max(self._sent, len(self._text) - self._longest + 1, 0)
        self._text += delta
        hits = [i for i in (self._text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self._text = self._text[:min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop string."""
        unsent = len(self._text) - self._sent
        for k in range(min(self._longest - 1, unsent), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
