"""The wire format of the multiplexed calls (``pdcluster.v1``, "Multiplexed calls"), shared by both halves.

One bidi stream per node and service carries many requests' calls: the proxy writes ``PrefillCalls`` /
``DecodeCalls`` messages (calls and cancels), the node answers with ``MuxReplies`` (each reply a
request's prefill answer, decode event or final ``CallStatus``). The client half is
``proxy.link.mux_client``, the server half ``node_runtime.mux_server``; this module is what both must
agree on, and holds no event loop:

- ``PREFILL`` / ``DECODE``: each service's multiplexed method and the message its calls travel in, and
  ``Service.encode``, which frames each call's own serialization as an element of the message's
  ``calls`` field (protobuf's wire format for a repeated message field), the cancels after them. The
  same bytes as the generated message would give, without copying every call (its prompt's token
  ids) into that message first: 7 against 16 us a 512-token call.
- ``Reply``, ``merged``, ``replies_message``: the node's queued replies, a request's queued token events
  merged into one, built into one ``MuxReplies`` (one copy of each) when the stream writes.
- ``status_reply`` / ``status_code``: a call's gRPC status as a ``CallStatus`` and back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import grpc

from cluster.proto_gen import pdcluster_v1_pb2 as pb


@dataclasses.dataclass(frozen=True)
class Service:
    """A node service's multiplexed method: its path and the message its calls travel in."""

    method: str
    calls_type: type[pb.PrefillCalls] | type[pb.DecodeCalls]

    @functools.cached_property
    def _calls_key(self) -> bytes:
        """The key of one element of the message's ``calls`` (its field number, length-delimited)."""
        return _varint(self.calls_type.DESCRIPTOR.fields_by_name["calls"].number << 3 | 2)

    def encode(self, calls: list[Any], cancels: list[str]) -> bytes:
        """``calls_type(calls=calls, cancel=cancels)``'s bytes, each call serialized once (no copy of
        it into the message)."""
        key = self._calls_key
        parts: list[bytes] = []
        for call in calls:
            body = call.SerializeToString()
            parts += (key, _varint(len(body)), body)
        if cancels:
            parts.append(self.calls_type(cancel=cancels).SerializeToString())
        return b"".join(parts)


def _method(service: str, name: str) -> str:
    return f"/{pb.DESCRIPTOR.services_by_name[service].full_name}/{name}"


PREFILL = Service(_method("PrefillService", "PrefillMux"), pb.PrefillCalls)
DECODE = Service(_method("DecodeService", "DecodeMux"), pb.DecodeCalls)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# A reply waiting to be written: (request id, which MuxReply field, its message). Replies are built
# into the outgoing message only when it is written (one copy of each).
Reply = tuple[str, str, Any]

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_reply(request_id: str, code: grpc.StatusCode, details: str) -> Reply:
    """The call's end: its status as the ``CallStatus`` reply."""
    return request_id, "status", pb.CallStatus(code=code.value[0], details=details)


def status_code(status: pb.CallStatus) -> grpc.StatusCode:
    """A ``CallStatus``'s gRPC code (UNKNOWN for a number this gRPC does not know)."""
    return _CODES.get(status.code, grpc.StatusCode.UNKNOWN)


def merged(replies: list[Reply]) -> list[Reply]:
    """``replies`` in order, each run of one request's token events (nothing of that request between
    them) merged into its first event."""
    out: list[Reply] = []
    open_tokens: dict[str, pb.DecodeEvent] = {}  # request id -> its last reply here, an unfinished tokens event
    for r in replies:
        rid, kind, message = r
        if kind == "event" and message.WhichOneof("event") == "tokens":
            prev = open_tokens.get(rid)
            if prev is not None:
                prev.tokens.tokens.extend(message.tokens.tokens)
                if message.tokens.finish_reason:
                    prev.tokens.finish_reason = message.tokens.finish_reason
                    del open_tokens[rid]
                continue
            if not message.tokens.finish_reason:
                open_tokens[rid] = message
        else:
            open_tokens.pop(rid, None)
        out.append(r)
    return out


def replies_message(replies: list[Reply]) -> pb.MuxReplies:
    """The ``MuxReplies`` message that carries ``replies`` (``merged``)."""
    message = pb.MuxReplies()
    add = message.replies.add
    for rid, kind, payload in merged(replies):
        add(request_id=rid, **{kind: payload})
    return message
