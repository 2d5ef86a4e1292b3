"""Lockstep for a decode node's DP replicas under expert parallelism: waves.

Each replica process is a whole engine holding 1/DP of the routed experts, so every MoE layer of every
step needs every replica (``engine.parallel.expert_parallel.ExpertGroup``). No driver steps them; they
keep in step by waves (vLLM's DP engines do the same):

- A replica with no wave running and no work waits for messages, as any replica does: an idle node
  runs no collectives.
- A replica that gets work starts wave ``w`` (its count of waves ended) and says so (``started(w)``);
  the node relays a ``Wake(w)`` to every other replica, which joins wave ``w`` if it has not ended it
  yet. Two replicas may start the same wave at once: a wave is known by its number, so a late or
  duplicate ``Wake`` is ignored.
- In a wave, every iteration of every replica's engine loop first agrees whether any replica has
  work (``ExpertGroup.busy``, one all-reduce), then runs one step (a replica without rows takes part in
  the MoE layers' collectives only, or with CUDA graphs replays the group's graph with padding rows). The
  iteration at which no replica has work ends the wave on every replica at once: they all saw the same answer.

A replica that dies or hangs leaves the others blocked in a collective until the group's timeout
(``EngineConfig.rank_timeout_s``): the step raises, the replica process ends, and the node fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.parallel.expert_parallel import ExpertGroup


@dataclass(frozen=True)
class Wake:
    """Another replica of the EP group started wave ``wave``: join it, unless it has ended here."""

    wave: int


class Waves:
    """One replica's view of its EP group's waves; called from its engine thread only."""

    def __init__(self, group: ExpertGroup, started: Callable[[int], None]) -> None:
        """``started(wave)``: tell the other replicas (through the node) that this one started ``wave``."""
        self.group = group
        self._started = started
        self.wave = 0  # waves ended so far: the number of the next (or the running) one
        self.running = False

    def join(self, wave: int) -> None:
        if not self.running and wave == self.wave:
            self.running = True

    def step_now(self, busy: bool) -> bool:
        """Whether this engine-loop iteration runs a step (every replica of the group decides alike);
        ``busy``: this replica has work."""
        if not self.running:
            if not busy:
                return False
            self.running = True
            self._started(self.wave)
        if self.group.busy(busy):
            return True
        self.running = False
        self.wave += 1
        return False
