"""Incremental detokenization (multi-byte characters split across tokens; ``DecodeStream``, and the
window through ``Tokenizer.decode`` for tokenizers that clean up spaces) and stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from proxy.api.detok import IncrementalDetokenizer, OutputText
from proxy.api.responses import TokenTexts

TEXT = "Prefill héllo wörld, 日本語 🎉🎉 done. The cache moves fast!"


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer(tiny_model)


@pytest.fixture(scope="module")
def ids(tok: Tokenizer) -> list[int]:
    out = tok.encode(TEXT, add_special_tokens=False)
    # the test is only meaningful if some character spans several tokens
    assert any(tok.decode([i]).endswith("\ufffd") for i in out)
    return out


def test_incremental_equals_full_decode(tok: Tokenizer, ids: list[int]) -> None:
    d = IncrementalDetokenizer(tok)
    text = ""
    for i in ids:
        delta = d.push(i)
        assert "\ufffd" not in delta  # never half a character
        text += delta
        assert tok.decode(ids).startswith(text)
    text += d.flush()
    assert text == TEXT


def test_rust_decode_stream_is_used_and_equals_decode_through_transformers(tok: Tokenizer, ids: list[int]) -> None:
    assert tok.stream_backend is not None  # the tiny model's config turns space clean-up off, as DeepSeek's do
    assert tok.stream_backend.decode(ids) == tok.decode(ids)


def test_window_through_decode_when_the_tokenizer_cleans_up_spaces(tok: Tokenizer, ids: list[int],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tok._tok, "clean_up_tokenization_spaces", True)
    assert tok.stream_backend is None
    d = IncrementalDetokenizer(tok)
    assert d._backend is None
    deltas = [d.push(i) for i in [*ids, tok.eos_token_id]]
    assert not any("\ufffd" in x for x in deltas)
    assert "".join(deltas) + d.flush() == tok.decode(ids)


def test_a_refusing_decode_stream_falls_back_to_the_window_mid_output(tok: Tokenizer, ids: list[int]) -> None:
    d = IncrementalDetokenizer(tok)
    text = "".join(d.push(i) for i in ids[:5])

    class Refusing:
        def step(self, backend: object, token_id: int) -> str:
            raise RuntimeError("InvalidPrefix")

    d._stream = Refusing()  # type: ignore[assignment]  # as DecodeStream does on a text it cannot extend
    for i in ids[5:]:
        delta = d.push(i)
        assert "\ufffd" not in delta
        text += delta
    assert d._backend is None and text + d.flush() == TEXT


def test_special_tokens_are_skipped(tok: Tokenizer, ids: list[int]) -> None:
    d = IncrementalDetokenizer(tok)
    text = "".join(d.push(i) for i in [*ids[:5], tok.eos_token_id]) + d.flush()
    assert text == tok.decode(ids[:5]) and "end" not in text


def test_incomplete_character_is_flushed_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("a🎉", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    text = "".join(d.push(i) for i in ids[:-1])
    assert text == "a"  # the emoji's first bytes are held
    assert d.flush().endswith("\ufffd")  # the output ended mid-character: show what there is


def stream(tok: Tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], OutputText, int]:
    """Feed tokens one by one; return the pieces taken, the output, and how many tokens were used."""
    out = OutputText(tok, stop)
    pieces, used = [], 0
    for i in ids:
        out.add(i)
        used += 1
        if out.stopped:
            break
        pieces.append(out.take())
    pieces.append(out.finish())
    return pieces, out, used


@pytest.mark.parametrize("stop", ["日本", "wörld", "🎉", "done. The", "e"])
def test_stop_string_cuts_and_is_never_partly_sent(tok: Tokenizer, ids: list[int], stop: str) -> None:
    pieces, out, used = stream(tok, ids, [stop, "never-there"])
    expected = TEXT[:TEXT.index(stop)]
    assert out.stopped and out.text == expected == "".join(pieces)
    sent = ""
    for p in pieces:
        sent += p
        assert stop not in sent
    # the last token used is the one that completed the stop string
    assert stop in tok.decode(ids[:used]) and stop not in tok.decode(ids[:used - 1])


def test_unmatched_stop_prefix_is_released_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("the cache is fast", add_special_tokens=False)
    pieces, out, _ = stream(tok, ids, ["fast!"])
    assert not out.stopped and "".join(pieces) == "the cache is fast"
    assert pieces[-1].endswith("fast")  # held back while it could have become "fast!"


def test_held_back_only_what_could_start_a_stop_string(tok: Tokenizer) -> None:
    out = OutputText(tok, ["XYZ"])
    for i in tok.encode("abc X", add_special_tokens=False):
        out.add(i)
    assert out.take() == "abc "  # "X" may begin "XYZ"
    for i in tok.encode("Q", add_special_tokens=False):
        out.add(i)
    assert out.take() == "XQ"


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer, ids: list[int]) -> None:
    _, out, _ = stream(tok, ids, ["done", "wörld"])
    assert out.text == TEXT[:TEXT.index("wörld")]


def test_no_stop_strings_sends_everything(tok: Tokenizer, ids: list[int]) -> None:
    pieces, out, used = stream(tok, ids, [])
    assert "".join(pieces) == TEXT and used == len(ids) and not out.stopped


def test_token_texts_for_logprobs(tok: Tokenizer, ids: list[int]) -> None:
    texts = TokenTexts(tok)
    assert texts.shown(tok.eos_token_id) == "<｜end▁of▁sentence｜>"
    assert texts.visible_len(tok.eos_token_id) == 0
    assert texts.visible_len(ids[0]) == len(tok.decode([ids[0]]))
