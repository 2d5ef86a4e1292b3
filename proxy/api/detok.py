"""Incremental detokenization and stop strings: token ids in, text deltas out.

``IncrementalDetokenizer`` turns output tokens into text with ``tokenizers``' ``DecodeStream``
(in Rust): it decodes only the tokens since the last piece, and never hands out text that ends
inside a UTF-8 character (a byte-level BPE token may hold half a character, which decodes to
U+FFFD until the next token completes it). ``OutputText`` adds stop strings: the text is cut
before the first occurrence of any of them, and while streaming, a tail that could be the
beginning of a stop string is held back, so a stop string is never partly sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decode a growing list of output token ids, one stable text delta at a time; special tokens
    (EOS...) decode to nothing, as in ``Tokenizer.decode``'s default.

    The window is DecodeStream's own: ``_window[:_read]`` holds the tokens of the last piece handed
    out, the rest those not handed out yet. ``DecodeStream`` has no end of stream, so ``flush``
    decodes what it still holds back (a character that never completed shows as U+FFFD, as in the
    whole output decoded at once). When the tokenizer's ``decode`` is not plain Rust decoding
    (``Tokenizer.stream_backend`` is None: it cleans up spaces), the same window is decoded through
    ``Tokenizer.decode`` instead, so the text still equals the whole output decoded at once.
    """

    def __init__(self, tokenizer: Tokenizer, keep: frozenset[int] = frozenset()) -> None:
        """``keep``: special tokens whose text is wanted all the same (a tool call's markers)."""
        self._tok = tokenizer
        self._backend = tokenizer.stream_backend
        self._stream = DecodeStream(skip_special_tokens=True)  # unused without a backend
        self._window: list[int] = []
        self._read = 0
        self._keep = keep

    def push(self, token_id: int) -> str:
        """Add a token; return the text that became stable (may be empty)."""
        if token_id in self._keep:  # what is held back, then the token's own text; then start afresh
            text = self.flush() + self._tok.decode([token_id], skip_special_tokens=False)
            self._window, self._read = [], 0
            self._stream = DecodeStream(skip_special_tokens=True)
            return text
        self._window.append(token_id)
        delta = None
        if self._backend is not None:
            try:
                delta = self._stream.step(self._backend, token_id)
            except Exception:  # DecodeStream refuses a window whose text does not extend the last one:
                self._backend = None  # decode through Tokenizer.decode from here on (the window is ours)
        if self._backend is None:
            delta = self._step_through_decode()
        if not delta:
            return ""
        self._window = self._window[self._read:]
        self._read = len(self._window)
        return delta

    def flush(self) -> str:
        """At the end of the output: whatever is left, an incomplete character included."""
        if self._read == len(self._window):
            return ""
        before = self._tok.decode(self._window[:self._read])
        text = self._tok.decode(self._window)
        self._read = len(self._window)  # the output has ended: nothing is held any more
        return text[len(before):]

    def _step_through_decode(self) -> str | None:
        """``DecodeStream.step``'s rule, decoding with ``Tokenizer.decode``."""
        before = self._tok.decode(self._window[:self._read])
        text = self._tok.decode(self._window)
        if len(text) <= len(before) or text.endswith(REPLACEMENT_CHAR):
            return None  # nothing new, or a character still incomplete
        return text[len(before):]


class OutputText:
    """One output's text as its tokens arrive, cut at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), keep: frozenset[int] = frozenset()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, keep)
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
        if not self._stops:
            self._text += delta
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
