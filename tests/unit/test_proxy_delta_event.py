"""``delta_event``: a delta's SSE event, the same bytes as ``sse(delta_chunk(...))`` for every text and
format, whether made from the request's pre-encoded frame (a plain delta) or not (logprobs, tools)."""

from __future__ import annotations

import pytest

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from proxy.api.responses import ChatFormat, CompletionFormat, TokenTexts, sse
from proxy.api.tool_calls import ToolCallStream

TEXTS = ["", " hello", 'quote " and back\\slash', "line\nbreak\ttab", "\x00\x1f control", "é 漢字 🙂",
         "\u2028\u2029", "</script>", "x" * 3000]


class _Decoder:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return f"<{ids[0]}>"


def _format(kind: type, **kw: object) -> CompletionFormat | ChatFormat:
    args = {"logprobs": False, "include_usage": False, **kw}
    return kind("req-" + "7" * 32, 1_700_000_000, 'model "q"', texts=TokenTexts(_Decoder()), **args)


@pytest.mark.parametrize("kind", [CompletionFormat, ChatFormat])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_a_delta_event_is_its_chunk_encoded(kind: type, include_usage: bool, logprobs: bool) -> None:
    framed, built = _format(kind, include_usage=include_usage, logprobs=logprobs), \
        _format(kind, include_usage=include_usage, logprobs=logprobs)
    tokens = [pb.Token(token_id=5, logprob=-0.5)]
    for text in TEXTS:  # the frame is made at the first event and reused for the rest
        assert framed.delta_event(text, tokens) == sse(built.delta_chunk(text, tokens)), text
    assert (framed._frame is not None) is (not logprobs)  # logprobs: every event built in full


def test_a_chat_delta_with_tools_is_built_in_full() -> None:
    framed, built = _format(ChatFormat), _format(ChatFormat)
    for f in (framed, built):
        assert isinstance(f, ChatFormat)
        f.offer_tools(ToolCallStream())
    for text in ("plain ", "text"):
        assert framed.delta_event(text, []) == sse(built.delta_chunk(text, []))
    assert framed._frame is None
