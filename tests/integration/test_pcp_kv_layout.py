"""Where the KV ends up under PCP × PP: sharded blocks reassemble to PCP1's KV, replicas are identical.

A 607-token prompt is prefilled in 128-token chunks (so later chunks read their context back from the
cache: gathered from the holders when sharded) and its blocks are held (``hold_kv``) for reading. The PCP2 x PP2
prefills are ``pcp2_pp2_handoff.py``'s, shared with ``test_disaggregated_transfer.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import prefill_held
from pcp2_pp2_handoff import PROMPT, held_kv

from engine import LLM

KW = dict(dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def pcp1(tiny_model):
    with LLM(str(tiny_model), **KW) as llm:
        eng = llm.engine
        prefill_held(eng, PROMPT)
        out = held_kv(eng)
        assert eng.release("r")
        out["used_after_release"] = eng.num_used_blocks
        return out


@pytest.fixture(scope="module")
def sharded(pcp2_pp2_handoffs: Callable[[str], dict[str, Any]]):
    return pcp2_pp2_handoffs("sharded")


@pytest.fixture(scope="module")
def replicated(pcp2_pp2_handoffs: Callable[[str], dict[str, Any]]):
    return pcp2_pp2_handoffs("replicated")


def test_pcp1_reference_holds_the_whole_prompt(pcp1) -> None:
    assert sorted(pcp1["kv"]) == [0, 1, 2]
    assert all(t.shape[0] == len(PROMPT) and not t.isnan().any() for t in pcp1["kv"].values())
    assert pcp1["used_after_release"] == 0


def test_sharded_blocks_reassemble_to_pcp1_kv(pcp1, sharded) -> None:
    ref, kv = pcp1["kv"], sharded["kv"]
    assert sorted(kv) == sorted(ref)
    # Layer 0's latents come from the embeddings alone: bit-identical. Deeper layers see attention
    # outputs summed in another order (zigzag runs merged by LSE), so they agree to float rounding.
    assert torch.equal(kv[0], ref[0])
    for layer in ref:
        assert not kv[layer].isnan().any(), f"layer {layer}: a position is held by no rank"
        torch.testing.assert_close(kv[layer], ref[layer], atol=1e-5, rtol=0)
    assert sharded["used_after_release"] == 0


def test_sharded_places_each_block_on_exactly_one_rank(pcp1, sharded) -> None:
    held = [{layer: ~t[:, 0].isnan() for layer, t in part.items()} for part in sharded["per_rank"]]
    for layer in pcp1["kv"]:
        assert torch.equal(held[0][layer] ^ held[1][layer], torch.ones(len(PROMPT), dtype=torch.bool))
        # block-sized interleave: positions [16j, 16j+16) on rank j % 2
        owner = (torch.arange(len(PROMPT)) // 16) % 2
        assert torch.equal(held[1][layer], owner == 1)
    # Cache usage per rank is about 1/PCP of PCP1's.
    assert sum(sharded["used_per_rank"]) == pcp1["used"]
    assert max(sharded["used_per_rank"]) == math.ceil(pcp1["used"] / 2)


def test_ownership_query_names_every_holder(sharded) -> None:
    own = sharded["ownership"]
    assert {(o.pcp, o.pp) for o in own} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert sorted({o.rank for o in own}) == [0, 1, 2, 3]
    for pp in (0, 1):
        stage = [o for o in own if o.pp == pp]
        assert stage[0].layers == stage[1].layers
        logical = sorted(stage[0].logical + stage[1].logical)
        assert logical == list(range(sharded["blocks"]))  # a partition of the request's blocks
    assert sorted(set(own[0].layers) | set(own[2].layers)) == [0, 1, 2]


def test_replicated_ranks_hold_identical_kv(pcp1, sharded, replicated) -> None:
    a, b = replicated["per_rank"]
    for layer in pcp1["kv"]:
        assert not a[layer].isnan().any() and torch.equal(a[layer], b[layer])
        # Same arithmetic as sharded, only placed differently: bit-identical to the reassembled shards.
        assert torch.equal(a[layer], sharded["kv"][layer])
    assert replicated["used"] == pcp1["used"]
    assert all(o.logical == list(range(replicated["blocks"])) for o in replicated["ownership"])
    assert replicated["used_after_release"] == 0
