"""An expert-parallel MoE layer in a CUDA graph's step (``MoE(..., static=True)``), on CPU.

Under expert parallelism the eager step picks out the gathered choices of this member's experts (their
number is read on the host); a graph's step cannot, so it passes every choice through and skips the other
members' (``ExpertParallel.local_choices``, ``MoE._local_sums``). Both give each row the weighted sum over
its choices of this member's experts; a padding row (NaN, as a graph's padding rows may be) stays in its own
row. ``tests/gpu/test_fused_kernels.py`` checks the CUDA form (the fused kernels skipping ids past the
experts) and that it captures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import Alone

from engine.config import ModelConfig
from engine.layers import MoE
from engine.parallel.expert_parallel import ExpertParallel, ExpertShard


@pytest.mark.parametrize("arch", ["v2_moe", "v3"])
def test_graph_path_equals_eager_path_and_the_members_add_up(tiny_models: dict[str, Path], arch: str) -> None:
    """Per member the graph path equals the eager one, a NaN padding row leaking into no other row; the two
    members' sums (each with the shared experts) add up to the layer without EP."""
    cfg = ModelConfig.from_pretrained(str(tiny_models[arch]))
    e = cfg.n_routed_experts
    assert e
    torch.manual_seed(0)
    whole = MoE(cfg)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.1)
    state = whole.state_dict()
    x = torch.randn(9, cfg.hidden_size)
    x[4] = float("nan")  # a padding row
    rows = torch.arange(9) != 4
    counts = [9, 9]
    sums = []
    with torch.inference_mode():
        for rank in (0, 1):
            member = MoE(cfg, ExpertParallel(ExpertShard(rank, 2, e), Alone()))
            half = slice(rank * e // 2, (rank + 1) * e // 2)
            member.load_state_dict({k: v[half] if k in ("w13", "w2") else v for k, v in state.items()})
            eager, graph = member(x, counts), member(x, counts, static=True)
            assert torch.isfinite(graph[rows]).all()
            torch.testing.assert_close(graph[rows], eager[rows], rtol=1e-5, atol=1e-6)
            sums.append(graph[rows])
        assert whole.shared_experts is not None
        want = whole(x[rows])
        torch.testing.assert_close(sums[0] + sums[1] - whole.shared_experts(x[rows]), want, rtol=1e-5, atol=1e-5)
