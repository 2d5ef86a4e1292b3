"""Decode CUDA graphs: replayed decode equals eager decode, token for token (greedy, bf16).

Thirteen requests of different prompt and output lengths: the batch shrinks as they finish, so
decode steps run at sizes on the capture ladder and between its sizes (padded); a small token
budget makes prompts prefill in chunks beside running decodes, so mixed steps run eagerly in
between replays.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
KW = dict(dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=96,
          gpu_memory_utilization=0.3)


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(3)
    lengths = [5, 17, 33, 64, 100, 130, 7, 250, 3, 41, 90, 12, 300]
    prompts = [torch.randint(3, 900, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, logprobs=2, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


# A replay pads the batch to its captured size, so its GEMMs run at other shapes than the eager
# step's and bf16 rounding of the hidden states differs: measured up to 0.07 on logprobs around -7
# (about 1%). Greedy tokens are the same wherever the eager top two are further apart than that;
# the tiny model's random weights make near-ties common enough that one shows up in some runs.
LOGPROB_TOL = 0.15


def test_graph_decode_equals_eager_decode(tiny_model) -> None:
    prompts, params = _requests()
    with LLM(str(tiny_model), enforce_eager=True, **KW) as eager:
        assert eager.engine.executor.graphs is None
        want = eager.generate(prompts, params)
    with LLM(str(tiny_model), **KW) as graphed:
        graphs = graphed.engine.executor.graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]  # captured, not fallen back
        got = graphed.generate(prompts, params)
        assert graphs.replays > 20  # most decode steps were replays
        assert graphed.engine.num_used_blocks == 0
    compared = 0
    for i, (w, g) in enumerate(zip(want, got)):
        n = _first_diff(w.token_ids, g.token_ids)
        assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(w.logprobs[:n], g.logprobs[:n])), i
        compared += n
        if n < len(w.token_ids):  # tokens may part only where the eager choice was a near-tie
            top = sorted(w.top_logprobs[n].values(), reverse=True)
            assert top[0] - top[1] < LOGPROB_TOL, (i, n, top, w.token_ids[n], g.token_ids[n])
    assert compared > 0.8 * sum(len(w.token_ids) for w in want)  # nearly all tokens compared equal


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
