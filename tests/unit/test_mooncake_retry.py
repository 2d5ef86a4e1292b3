"""The Mooncake transport's batch loop against a scripted engine: a failed batch is submitted again
(the engine's TCP lanes fail transfers for passing reasons), and fails the read after RETRIES."""

from __future__ import annotations

import pytest

from kv_transfer.transport import Segment, TransferError
from kv_transfer.transports import mooncake


class ScriptedEngine:
    """Answers each batch's first status query with the next scripted status (then 0: done)."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.submitted: list[tuple[str, int]] = []  # (peer, segments)
        self.asked: set[int] = set()

    def batch_transfer_async_read(self, peer: str, local: list[int], remote: list[int], sizes: list[int]) -> int:
        self.submitted.append((peer, len(local)))
        return len(self.submitted)  # batch ids from 1 (0 means "could not start")

    def get_batch_transfer_status(self, batches: list[int]) -> int:
        (batch,) = batches
        if batch in self.asked or not self.statuses:
            return 0
        self.asked.add(batch)
        return self.statuses.pop(0)


def transport(statuses: list[int]) -> mooncake.MooncakeTransport:
    t = mooncake.MooncakeTransport.__new__(mooncake.MooncakeTransport)
    t._engine = ScriptedEngine(statuses)
    return t


SEGMENTS = [Segment(1000 + i, 5000 + i, 8) for i in range(3)]


def test_a_failed_batch_is_submitted_again_and_the_read_completes(caplog: pytest.LogCaptureFixture) -> None:
    t = transport([-1, -1])  # the first two attempts fail, the third completes
    t.read("peer:1", SEGMENTS, timeout_s=5)
    assert t._engine.submitted == [("peer:1", 3)] * 3
    assert "submitting it again" in caplog.text


def test_a_batch_that_keeps_failing_fails_the_read_as_refused() -> None:
    t = transport([-1] * 2 * (mooncake.RETRIES + 1))  # every attempt of both batches fails
    with pytest.raises(TransferError) as e:
        t.read_all({"a:1": SEGMENTS, "b:2": SEGMENTS}, timeout_s=5)
    assert e.value.cause == "refused" and f"{mooncake.RETRIES + 1} attempts" in str(e.value)


def test_only_the_failed_batch_goes_again() -> None:
    t = transport([0, -1])  # peer a's batch completes, peer b's fails once
    t.read_all({"a:1": SEGMENTS, "b:2": SEGMENTS[:2]}, timeout_s=5)
    assert t._engine.submitted == [("a:1", 3), ("b:2", 2), ("b:2", 2)]


def test_a_retry_frees_its_in_flight_share() -> None:
    # Three batches of MAX_BATCH: more than MAX_IN_FLIGHT, so the third waits for room. A failed
    # batch that kept its share of in_flight would leave the read waiting until its timeout.
    n = 3 * mooncake.MAX_BATCH
    assert n > mooncake.MAX_IN_FLIGHT
    t = transport([-1, -1])  # the first two batches fail once each
    t.read("peer:1", [Segment(i, i, 1) for i in range(n)], timeout_s=5)
    assert len(t._engine.submitted) == 5


def test_a_batch_still_pending_at_the_deadline_is_a_timeout() -> None:
    t = transport([])
    t._engine.get_batch_transfer_status = lambda batches: 1  # PENDING, always
    with pytest.raises(TransferError) as e:
        t.read("peer:1", SEGMENTS, timeout_s=0.2)
    assert e.value.cause == "timeout"


class UnstartableEngine(ScriptedEngine):
    """Cannot start its first ``refusals`` batches (submit returns 0, as when the handshake fails)."""

    def __init__(self, refusals: int) -> None:
        super().__init__([])
        self.refusals = refusals

    def batch_transfer_async_read(self, peer: str, local: list[int], remote: list[int], sizes: list[int]) -> int:
        if self.refusals:
            self.refusals -= 1
            self.submitted.append((peer, 0))
            return 0
        return super().batch_transfer_async_read(peer, local, remote, sizes)


def test_a_batch_that_could_not_start_is_tried_again(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(mooncake, "START_PAUSE_S", 0.01)
    t = transport([])
    t._engine = UnstartableEngine(mooncake.START_RETRIES)  # the last allowed attempt starts it
    t.read("peer:1", SEGMENTS, timeout_s=5)
    assert t._engine.submitted[-1] == ("peer:1", 3) and len(t._engine.submitted) == mooncake.START_RETRIES + 1
    assert "could not start a batch with peer:1" in caplog.text


def test_a_peer_that_never_starts_a_batch_is_gone_after_the_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake, "START_PAUSE_S", 0.01)
    t = transport([])
    t._engine = UnstartableEngine(100)
    with pytest.raises(TransferError) as e:
        t.read("peer:1", SEGMENTS, timeout_s=5)
    assert e.value.cause == "peer_gone" and f"{mooncake.START_RETRIES + 1} attempts" in str(e.value)
    assert len(t._engine.submitted) == mooncake.START_RETRIES + 1


def test_no_start_retry_past_the_timeout() -> None:
    t = transport([])
    t._engine = UnstartableEngine(100)
    with pytest.raises(TransferError) as e:
        t.read("peer:1", SEGMENTS, timeout_s=0.1)  # shorter than the first pause (START_PAUSE_S)
    assert e.value.cause == "peer_gone" and len(t._engine.submitted) == 1
