"""``engine.expert_choice``: the router's choice of experts in one kernel equals ``layers.Router``'s torch ops on
the same fp32 logits, for V2's greedy and group-limited softmax and V3's ``noaux_tc`` sigmoid (ids as sets, weights
to fp32 rounding), at V2-Lite's, V2's and V3's expert counts. On CUDA; as a script under ``TRITON_INTERPRET=1`` on
CPU.

  TRITON_INTERPRET=1 PYTHONPATH=.:tests python tests/gpu/test_expert_choice.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import expert_choice
from engine.config import ModelConfig
from engine.layers import Router

pytestmark = pytest.mark.gpu
# (experts, k, scoring, method, n_group, topk_group, norm, scale): V2-Lite, V2, V3, then groups that are not a power
# of two (the kernel's group block is padded)
CASES = [(64, 6, "softmax", "greedy", 1, 1, False, 1.0), (160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0),
         (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5), (72, 5, "sigmoid", "noaux_tc", 3, 2, True, 1.0),
         (160, 7, "softmax", "group_limited_greedy", 5, 2, True, 1.0)]


def _config(case: tuple) -> ModelConfig:
    e, k, scoring, method, n_group, topk_group, norm, scale = case
    return ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=1, kv_lora_rank=64, qk_nope_head_dim=64,
                      qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=e, num_experts_per_tok=k,
                      moe_intermediate_size=64, scoring_func=scoring,
                      topk_method=method, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                      routed_scaling_factor=scale)


def _router(case: tuple, seed: int) -> Router:
    e, method = case[0], case[3]
    g = torch.Generator().manual_seed(seed)
    router = Router(_config(case))
    router.weight.data = torch.randn(e, 64, generator=g)
    if method == "noaux_tc":
        router.e_score_correction_bias.data = torch.randn(e, generator=g) * 0.1
    return router


def check(case: tuple, tokens: int, device: str) -> None:
    e, k, scoring, method, n_group, topk_group, norm, scale = case
    router = _router(case, e + tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    want_w, want_ids = router(x)  # torch's ops, on CPU
    logits = torch.nn.functional.linear(x, router.weight).to(device)
    bias = router.e_score_correction_bias.data.to(device) if method == "noaux_tc" else None
    got_w, got_ids = expert_choice.choose(logits, k, sigmoid=scoring == "sigmoid", method=method, n_group=n_group,
                                          topk_group=topk_group, bias=bias, norm=norm, scale=scale)
    got_w, got_ids = got_w.cpu(), got_ids.cpu()
    assert got_ids.dtype == want_ids.dtype and got_ids.shape == want_ids.shape == (tokens, k)
    order, want_order = got_ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(got_ids.gather(1, order), want_ids.gather(1, want_order)), "other experts chosen"
    torch.testing.assert_close(got_w.gather(1, order), want_w.gather(1, want_order), rtol=1e-5, atol=1e-6)


def check_odd_rows(device: str) -> None:
    """Rows no router should meet still get K distinct ids in [0, E): NaN logits (one, or all), and K beyond the
    experts of the kept groups (E=16 in 8 groups, one kept, K=4)."""
    for case in CASES + [(16, 4, "sigmoid", "noaux_tc", 8, 1, True, 1.0)]:
        e, k, scoring, method, n_group, topk_group, norm, scale = case
        logits = torch.randn(3, e)
        logits[0, 5] = float("nan")
        logits[1] = float("nan")
        bias = torch.zeros(e, device=device) if method == "noaux_tc" else None
        _, ids = expert_choice.choose(logits.to(device), k, sigmoid=scoring == "sigmoid", method=method,
                                      n_group=n_group, topk_group=topk_group, bias=bias, norm=norm, scale=scale)
        ids = ids.cpu()
        assert bool(((ids >= 0) & (ids < e)).all()), (case, ids)
        assert all(len(set(row.tolist())) == k for row in ids), (case, ids)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}-E{c[0]}-G{c[4]}")
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_the_kernel_chooses_what_the_router_does(case: tuple, tokens: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check(case, tokens, "cuda")


def test_odd_rows_get_distinct_ids_in_range() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_odd_rows("cuda")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}-E{c[0]}-G{c[4]}")
def test_the_router_on_cuda_takes_the_kernel_and_chooses_as_its_torch_ops(case: tuple,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``Router.forward`` hands its config to the kernel as its torch ops read it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    router = _router(case, 0).cuda()
    x = torch.randn(50, 64, device="cuda")
    calls: list[int] = []
    real = expert_choice.choose
    monkeypatch.setattr(expert_choice, "choose", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got_w, got_ids = router(x)
    assert calls
    monkeypatch.setattr(expert_choice, "usable", lambda *a: False)
    want_w, want_ids = router(x)
    assert len(calls) == 1
    order, want_order = got_ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(got_ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(got_w.gather(1, order), want_w.gather(1, want_order), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [0, 1, 64, 256])  # 0: an expert-parallel member with no rows
def test_a_router_held_in_bf16_gives_the_fp32_logits(tokens: int) -> None:
    """Weights that are bf16 values held in bf16: a bf16 input's logits from one bf16 GEMM summing in fp32 are the
    fp32 GEMM's (the same exact products, summed in another order), at V3's width."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case = CASES[2]
    cfg = dataclasses.replace(_config(case), hidden_size=7168)
    router = Router(cfg).cuda()
    g = torch.Generator(device="cuda").manual_seed(tokens)
    router.weight.data = (torch.randn(256, 7168, device="cuda", generator=g) * 7168**-0.5).bfloat16().float()
    x = torch.randn(tokens, 7168, device="cuda", generator=g).bfloat16()
    want = torch.nn.functional.linear(x.double(), router.weight.double())
    fp32 = router.logits(x)
    assert router.hold_bf16() and router.weight.dtype == torch.bfloat16
    got = router.logits(x)
    assert got.dtype == torch.float32 and got.shape == (tokens, 256)
    # fp32 sums of 7,168 exact products: each within a few fp32 ulps of the sum's magnitude, as the fp32 GEMM's
    scale = x.float().abs() @ router.weight.float().abs().T
    if tokens:
        assert float(((got - want) / scale).abs().max()) < 1e-5
        assert float(((fp32 - want) / scale).abs().max()) < 1e-5
    inexact = Router(cfg).cuda()
    inexact.weight.data[0, 0] = 1.0 + 2.0**-12  # not a bf16 value: the router stays fp32
    assert not inexact.hold_bf16() and inexact.weight.dtype == torch.float32


if __name__ == "__main__":  # TRITON_INTERPRET=1, on CPU
    for c in CASES:
        for n in (1, 7):
            check(c, n, "cpu")
    check_odd_rows("cpu")
    print("ok")
