"""The messages between the driver and its rank processes (over each rank's pipe), in protocol order.

``RankGroup`` (``rank_group.py``) owns the first and last: a rank says ``Ready`` once it joined the
process group, ``RankError`` (with its traceback) when it fails, and gets ``Stop`` at shutdown. In
between, the rank worker (``rank_worker.py``) and the driver (``replica.py``) speak:

1. rank -> ``Loaded`` (how many KV blocks it could hold); driver -> ``SizeCache`` (the minimum over
   every rank); rank -> ``CacheReady`` (with the node's ``CacheExporter`` answer, when it gave one).
2. driver -> ``RunStep``: every rank of the replica runs the plan; the last PP stage's PCP rank 0
   answers ``StepOutput`` with the logits rows in plan order.
3. driver -> ``RunDraft`` (speculative decoding, after a step's ``StepOutput``, before the next ``RunStep``):
   the last PP stage's PCP ranks run the multi-token prediction layer over their rows of that step;
   when the driver asks for drafts, that stage's PCP rank 0 answers ``Drafted``.
4. driver -> ``ReadBlocks``: the rank answers ``Blocks`` (tests reassemble the KV this way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel.step_plan import StepPlan


@dataclass(frozen=True)
class Ready:
    rank: int


@dataclass(frozen=True)
class RankError:
    text: str  # "rank N: <traceback>"


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Loaded:
    capacity_blocks: int
    expert_params: int = 0  # routed-expert parameters the rank holds (1/EP of the model's with expert parallelism)


@dataclass(frozen=True)
class SizeCache:
    num_blocks: int


@dataclass(frozen=True)
class CacheReady:
    rank: int
    export: object  # what the node's CacheExporter answered (None without one)


@dataclass(frozen=True)
class RunStep:
    plan: StepPlan


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor | None  # [rows needing logits, vocab] in plan order (None: no such rows)


@dataclass(frozen=True)
class RunDraft:
    next_ids: torch.Tensor  # [rows of the last step, flattened in plan order] int64: the token after each row's
    picks: list[int]  # flattened plan rows whose prediction is a draft (empty: none, and no answer)
    extra: list[int] | None = None  # further drafts after each pick's first (k > 1; None: none)
    tables: list[list[int]] | None = None  # with ``extra``: each pick's global block table, covering them


@dataclass(frozen=True)
class Drafted:
    tokens: list[list[int]]  # the drafts at each of ``RunDraft.picks`` (1 + its ``extra``)


@dataclass(frozen=True)
class ReadBlocks:
    physical: list[int]


@dataclass(frozen=True)
class Blocks:
    layers: dict[int, torch.Tensor]  # layer -> [n, block_size, L + R]
