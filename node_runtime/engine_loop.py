"""The engine thread both node roles run: typed messages in, engine steps, load out, answers after.

Every engine call of a node happens on its engine thread(s); gRPC handlers and transfer threads
talk to one with ``send(message)`` (a frozen dataclass the subclass dispatches with ``match``). One
iteration of the loop:

1. ``handle`` every message in the inbox;
2. ``step``: housekeeping (lease expiry, quarantine) and one engine step where there is work;
   returns how many tokens were scheduled; after the messages and after the step, ``flush`` hands
   over what they buffered for the requests' streams (one wake-up for all of them);
3. ``publish`` the load the heartbeat reads;
4. run the ``answer`` callbacks queued meanwhile, so an answer is never seen before the load it
   changed;
5. with nothing scheduled, sleep until the next message (at most ``IDLE_WAIT_S``): the loop may be
   waiting for blocks held outside the scheduler (leases, pulls, quarantine).

An exception out of a hook means the engine can no longer serve: ``on_failure`` fails whatever is
pending and the thread ends.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("pdcluster.node")
IDLE_WAIT_S = 0.05


class EngineLoop:
    def __init__(self, name: str) -> None:
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._answers: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- any thread ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def send(self, message: object) -> None:
        self._inbox.put(message)
        self._wake.set()

    def request_stop(self) -> None:
        """Ask the thread to end after its current iteration (returns at once)."""
        self._stopping = True
        self._wake.set()

    def join(self, timeout_s: float = 30.0) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        self.request_stop()
        self.join(timeout_s)

    @property
    def stopping(self) -> bool:
        return self._stopping

    # -- the engine thread ---------------------------------------------------------------------
    def answer(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once this iteration's load is published."""
        self._answers.append(callback)

    def handle(self, message: object) -> None:
        raise NotImplementedError

    def step(self) -> int:
        raise NotImplementedError

    def publish(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Hand over the events ``handle`` and ``step`` buffered (by default nothing is buffered)."""

    def on_failure(self, error: BaseException) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        try:
            while not self._stopping:
                handled = False
                while True:
                    try:
                        message = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    self.handle(message)
                    handled = True
                if handled:
                    self.flush()
                scheduled = self.step()
                self.flush()
                self.publish()
                answers, self._answers = self._answers, []
                for answer in answers:
                    answer()
                if not scheduled:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as e:  # a rank died or the engine broke: nothing more can be served
            log.exception("%s failed", self._thread.name)
            self.on_failure(e)
