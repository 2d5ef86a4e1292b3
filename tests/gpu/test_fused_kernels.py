"""The decode step's fused Triton kernels against the torch code they replace.

- ``engine.norm_kernels.rms_norm`` (with and without the residual add) against ``RMSNorm``'s torch path;
- ``engine.norm_kernels.mla_latent`` against MLA's torch steps (kv_c norm, rope of k_pe and q_pe, the
  latent row and its cache write), interleaved and not;
- ``engine.moe_kernels.fused_experts`` against a per-(token, choice) fp32 loop, with experts that get no
  rows, experts with more rows than a tile, and inside a CUDA graph; the MoE module's fused path against
  its grouped-GEMM / loop path;
- ``engine.moe_kernels.combine`` (the weighted sum of each token's expert rows, through a permutation or
  in order, plus the shared experts) and ``silu_mul`` against torch in fp32.

Tolerances: the fused kernels round where the torch code rounds, so norms and rope agree to one bf16
rounding step (2^-7 relative; sums of squares are added in another order); the experts' GEMMs keep fp32
sums and round once, within 2^-6 of the output's scale in bf16. Plain functions of a device, so they also
run under Triton's interpreter on CPU:

  TRITON_INTERPRET=1 python tests/gpu/test_fused_kernels.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too: tests/engine_helpers.py

from engine import moe_kernels, moe_routing, norm_kernels  # noqa: E402
from engine.config import RopeConfig  # noqa: E402
from engine.kv_format import KVFormat  # noqa: E402
from engine.layers import RMSNorm  # noqa: E402
from engine.rope import RotaryEmbedding  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not norm_kernels.HAS_TRITON, reason="needs triton")]


def _torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * xf.to(x.dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def check_rms_norm(device: str, dtype: torch.dtype, d: int = 2048, t: int = 37) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(d, 1e-6).to(device=device, dtype=dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(d, generator=g)).to(device=device, dtype=dtype)
    x = (3 * torch.randn(t, d, generator=g)).to(device=device, dtype=dtype)
    res = torch.randn(t, d, generator=g).to(device=device, dtype=dtype)
    tol = 2.0**-7 if dtype != torch.float32 else 1e-5
    out, none = norm_kernels.rms_norm(x, norm.weight, norm.eps)
    assert none is None and out.dtype == dtype
    assert rel_err(out, _torch_norm(norm, x)) <= tol
    out, summed = norm_kernels.rms_norm(x, norm.weight, norm.eps, residual=res)
    assert summed is not None and torch.equal(summed, x + res), "the new residual is x + residual, rounded once"
    assert rel_err(out, _torch_norm(norm, x + res)) <= tol
    strided = torch.randn(t, d + 64, generator=g).to(device=device, dtype=dtype)[:, :d]  # a row view (kv_a[:, :L])
    assert rel_err(norm_kernels.rms_norm(strided, norm.weight, norm.eps)[0], _torch_norm(norm, strided)) <= tol
    assert norm_kernels.rms_norm(x[:0], norm.weight, norm.eps)[0].shape == (0, d)


def check_mla_latent(device: str, dtype: torch.dtype, interleave: bool, lat: int = 512, rope_dim: int = 64,
                     heads: int = 16, nope: int = 128, t: int = 9) -> None:
    g = torch.Generator().manual_seed(1)
    rope_cfg = RopeConfig(rope_type="yarn", theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                          beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707, interleave=interleave)
    rope = RotaryEmbedding(rope_cfg, rope_dim, 8192, torch.device(device))
    norm = RMSNorm(lat, 1e-6).to(device=device, dtype=dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(lat, generator=g)).to(device=device, dtype=dtype)
    kv_a = torch.randn(t, lat + rope_dim, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(t, heads, nope + rope_dim, generator=g).to(device=device, dtype=dtype)
    positions = torch.randint(0, 8192, (t,), generator=g).to(device)
    cache = torch.zeros(64, lat + rope_dim, dtype=dtype, device=device)
    slots = torch.randperm(64, generator=g)[:t].to(device)
    want_q_pe = rope.apply(q[..., nope:], positions)
    want_q_nope = q[..., :nope].clone()
    want = torch.cat((_torch_norm(norm, kv_a[:, :lat]), rope.apply(kv_a[:, lat:], positions)), dim=-1)
    latent = norm_kernels.mla_latent(kv_a, norm.weight, norm.eps, lat, positions, rope.cos, rope.sin, interleave, q,
                                     nope, cache, slots)
    tol = 2.0**-7 if dtype != torch.float32 else 1e-5
    assert rel_err(latent[:, :lat], want[:, :lat]) <= tol, "kv_c"
    assert rel_err(latent[:, lat:], want[:, lat:]) <= tol, "k_pe"
    assert rel_err(q[..., nope:], want_q_pe) <= tol, "q_pe (rotated in place)"
    assert torch.equal(q[..., :nope], want_q_nope), "q_nope untouched"
    assert torch.equal(cache[slots], latent), "the cache slots hold the latent rows"
    untouched = torch.ones(64, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (cache[untouched] == 0).all(), "no other cache slot written"


def check_mla_latent_quantized(device: str, name: str, interleave: bool, t: int = 9) -> None:
    """The fused write into an FP8 cache stores what ``KVFormat.encode`` makes of the latent it returns
    (its bytes: e4m3 values may differ by one step where a value lies on a rounding tie)."""
    g = torch.Generator().manual_seed(2)
    lat, rope_dim, heads, nope, dtype = 512, 64, 16, 128, torch.bfloat16
    rope_cfg = RopeConfig(rope_type="default", theta=10000.0, interleave=interleave)
    rope = RotaryEmbedding(rope_cfg, rope_dim, 8192, torch.device(device))
    norm = RMSNorm(lat, 1e-6).to(device=device, dtype=dtype)
    norm.weight.data = (1 + 0.5 * torch.randn(lat, generator=g)).to(device=device, dtype=dtype)
    kv_a = (torch.randn(t, lat + rope_dim, generator=g) * 3).to(device=device, dtype=dtype)
    q = torch.randn(t, heads, nope + rope_dim, generator=g).to(device=device, dtype=dtype)
    positions = torch.randint(0, 8192, (t,), generator=g).to(device)
    fmt = KVFormat(name, lat, rope_dim, dtype)
    cache = torch.zeros(64, fmt.row_width, dtype=fmt.storage_dtype, device=device)
    slots = torch.randperm(64, generator=g)[:t].to(device)
    latent = norm_kernels.mla_latent(kv_a, norm.weight, norm.eps, lat, positions, rope.cos, rope.sin, interleave, q,
                                     nope, cache, slots, kv_format=fmt)
    want = fmt.encode(latent)
    got_v, want_v = fmt.decode(cache[slots]).float(), fmt.decode(want).float()
    assert (got_v == want_v).float().mean() >= 0.999, "the stored rows are the format's encoding of the latent"
    assert ((got_v - want_v).abs() <= want_v.abs() / 8 + 2.0**-9).all(), "at most one e4m3 step apart"
    if name == "fp8_ds_mla":  # the scales and the bf16 rope bytes exactly
        assert torch.equal(cache[slots][:, 512:], want[:, 512:])
    untouched = torch.ones(64, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (cache[untouched].view(torch.uint8) == 0).all(), "no other cache slot written"


def check_experts(device: str, dtype: torch.dtype, t: int, k: int, e: int, d: int, inter: int, seed: int = 0,
                  crowd: bool = False) -> float:
    """fused_experts vs the fp32 loop; ``crowd`` sends every token to the same few experts (rows > a tile)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(device=device, dtype=dtype)
    if crowd:
        ids = torch.stack([torch.arange(k) for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids = ids.to(device)
    w13 = (torch.randn(e, 2 * inter, d, generator=g) / d**0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(e, d, inter, generator=g) / inter**0.5).to(device=device, dtype=dtype)
    out = moe_kernels.fused_experts(x, ids, w13, w2)
    ref = moe_kernels.fused_experts_reference(x, ids, w13, w2)
    assert out.shape == (t, k, d) and out.dtype == dtype
    err = rel_err(out, ref)
    tol = 2.0**-6 if dtype != torch.float32 else 1e-5
    assert err <= tol, f"fused experts T={t} K={k} E={e}: {err:.3g} > {tol:.3g}"
    return err


def check_experts_graph(device: str = "cuda") -> None:
    """Captured once; replayed with other routings (other experts empty or crowded) gives the new results."""
    g = torch.Generator().manual_seed(5)
    t, k, e, d, inter = 8, 6, 64, 256, 128
    x = torch.randn(t, d, generator=g).to(device=device, dtype=torch.bfloat16)
    ids = torch.zeros(t, k, dtype=torch.long, device=device)
    w13 = (torch.randn(e, 2 * inter, d, generator=g) / d**0.5).to(device=device, dtype=torch.bfloat16)
    w2 = (torch.randn(e, d, inter, generator=g) / inter**0.5).to(device=device, dtype=torch.bfloat16)
    moe_kernels.fused_experts(x, ids, w13, w2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_kernels.fused_experts(x, ids, w13, w2)
    for seed in range(3):
        gg = torch.Generator().manual_seed(seed)
        new_ids = torch.stack([torch.randperm(e if seed != 1 else k, generator=gg)[:k] for _ in range(t)])
        ids.copy_(new_ids)
        x.copy_(torch.randn(t, d, generator=gg))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, moe_kernels.fused_experts_reference(x, ids, w13, w2)) <= 2.0**-6, f"replay {seed}"


def check_experts_skipped(device: str, dtype: torch.dtype, t: int = 33, k: int = 6, d: int = 256,
                          inter: int = 128) -> None:
    """Choices of ids past the experts (``>= E``; expert parallelism's graphs pass other ranks' choices so) are
    skipped: every other slot equals the reference and the routing counts only them, with E a power of two
    (the id has no column) and not, through one routing program and through chunks."""
    g = torch.Generator().manual_seed(8)
    saved = moe_routing.ROUTE_SPLIT_ROWS
    try:
        for e in (8, 6):
            x = torch.randn(t, d, generator=g).to(device=device, dtype=dtype)
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            skip = torch.rand(t, k, generator=g) < 0.5
            skip[0] = True  # a token with no choice of its own
            ids = torch.where(skip, e, ids).to(device)
            w13 = (torch.randn(e, 2 * inter, d, generator=g) / d**0.5).to(device=device, dtype=dtype)
            w2 = (torch.randn(e, d, inter, generator=g) / inter**0.5).to(device=device, dtype=dtype)
            ref = moe_kernels.fused_experts_reference(x, ids, w13, w2)
            kept = ~skip.to(device)
            for split in (0, 1):
                moe_routing.ROUTE_SPLIT_ROWS = split
                offs = moe_routing.route(ids, e)[0]
                assert int(offs[-1]) == int(kept.sum()), f"E={e}: {int(offs[-1])} rows routed"
                out = moe_kernels.fused_experts(x, ids, w13, w2)
                err = rel_err(out[kept], ref[kept])
                assert err <= (2.0**-6 if dtype != torch.float32 else 1e-5), f"E={e} split={split}: {err:.3g}"
    finally:
        moe_routing.ROUTE_SPLIT_ROWS = saved


def check_route_split(device: str, cases: tuple[tuple[int, int, int], ...] = ((1, 6, 64), (300, 6, 64), (700, 8, 256),
                                                                           (37, 2, 8), (3000, 8, 256))) -> None:
    """Routing over chunks of rows (three kernels) places every row where the one-program routing does (the
    last case: 750 chunks, the offsets' loop over many tiles of them)."""
    g = torch.Generator().manual_seed(6)
    saved = moe_routing.ROUTE_SPLIT_ROWS
    try:
        for t, k, e in cases:
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
            moe_routing.ROUTE_SPLIT_ROWS = 0
            want = moe_routing.route(ids, e)
            moe_routing.ROUTE_SPLIT_ROWS = 1
            got = moe_routing.route(ids, e)
            for name, a, b in zip(("offs", "src", "order"), want, got):
                assert torch.equal(a, b), f"T={t} K={k} E={e}: {name} differs"
            counts = torch.bincount(ids.flatten(), minlength=e).cpu()
            assert torch.equal(want[0].cpu().diff(), counts.to(torch.int32)), "offs: rows per expert"
    finally:
        moe_routing.ROUTE_SPLIT_ROWS = saved


def check_shared_slots(device: str, dtype: torch.dtype, cases: tuple[tuple[int, int, int, int], ...] = (
        (1, 6, 64, 2), (100, 6, 64, 2), (700, 8, 256, 1), (37, 2, 8, 2), (33, 0, 8, 2)), d: int = 64,
        inter: int = 32) -> None:
    """Shared experts as the stack's last S experts, chosen by every token (``fused_experts(shared=S)``): the
    routing lays their rows out exactly where routing the ids with S more columns (E..E+S-1) counts them, through
    one program and through chunks; the outputs and ``combine(slots=S)`` equal those of the widened ids. K = 0:
    the shared experts alone (``MoE._shared_sums`` under expert parallelism)."""
    g = torch.Generator().manual_seed(9)
    saved = moe_routing.ROUTE_SPLIT_ROWS
    try:
        for t, k, e, s in cases:
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
            wide = torch.cat([ids, torch.arange(e, e + s, device=device).expand(t, s)], 1).contiguous()
            for split in (0, 1):
                moe_routing.ROUTE_SPLIT_ROWS = split
                for name, a, b in zip(("offs", "src", "order"), moe_routing.route(wide, e + s),
                                      moe_routing.route(ids, e, s)):
                    assert torch.equal(a, b), f"T={t} K={k} E={e} S={s} split={split}: {name} differs"
            if t * (k + s) > 1000:
                continue  # (the kernels' sizes below: the interpreter is slow)
            x = torch.randn(t, d, generator=g).to(device=device, dtype=dtype)
            w13 = (torch.randn(e + s, 2 * inter, d, generator=g) / d**0.5).to(device=device, dtype=dtype)
            w2 = (torch.randn(e + s, d, inter, generator=g) / inter**0.5).to(device=device, dtype=dtype)
            out = moe_kernels.fused_experts(x, ids, w13, w2, shared=s)
            assert out.shape == (t, k + s, d)
            assert torch.equal(out, moe_kernels.fused_experts(x, wide, w13, w2))
            w = torch.rand(t, k, generator=g).to(device)
            w_wide = torch.cat([w, torch.ones(t, s, device=device)], 1)
            assert torch.equal(moe_kernels.combine(out, w, slots=s), moe_kernels.combine(out, w_wide))
    finally:
        moe_routing.ROUTE_SPLIT_ROWS = saved


def check_combine(device: str, dtype: torch.dtype, t: int = 37, k: int = 6, d: int = 200) -> None:
    g = torch.Generator().manual_seed(3)
    y = torch.randn(t * k, d, generator=g).to(device=device, dtype=dtype)
    w = torch.rand(t, k, generator=g).to(device)  # fp32, as the router gives them
    shared = torch.randn(t, d, generator=g).to(device=device, dtype=dtype)
    perm = torch.randperm(t * k, generator=g).to(device)  # row perm[i] holds flat (token, choice) i
    moved = torch.empty_like(y)
    moved[perm] = y
    want = (w.unsqueeze(-1) * y.float().view(t, k, d)).sum(1)
    tol = 2.0**-7 if dtype != torch.float32 else 1e-5
    out = moe_kernels.combine(y, w, shared=shared)
    assert out.shape == (t, d) and out.dtype == dtype
    assert rel_err(out, want + shared.float()) <= tol, "in (token, choice) order, plus shared"
    assert rel_err(moe_kernels.combine(moved, w, row_of=perm), want) <= tol, "through the permutation"
    assert rel_err(moe_kernels.combine(y.view(t, k, d), w), want) <= tol, "[T, K, D] input"
    assert moe_kernels.combine(y[:0], w[:0]).shape == (0, d)


def check_silu_mul(device: str, dtype: torch.dtype, n: int = 29, inter: int = 1408) -> None:
    g = torch.Generator().manual_seed(4)
    h = (2 * torch.randn(n, 2 * inter, generator=g)).to(device=device, dtype=dtype)
    want = torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()
    out = moe_kernels.silu_mul(h)
    assert out.shape == (n, inter) and out.dtype == dtype
    assert rel_err(out, want) <= (2.0**-7 if dtype != torch.float32 else 1e-5)


EXPERT_CASES = [(1, 6, 64, 2048, 1408), (64, 6, 64, 2048, 1408), (3, 2, 8, 96, 40), (200, 8, 256, 256, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm(dtype: torch.dtype) -> None:
    check_rms_norm("cuda", dtype)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_latent(interleave: bool, dtype: torch.dtype) -> None:
    check_mla_latent("cuda", dtype, interleave)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("name", ["fp8", "fp8_ds_mla"])
def test_mla_latent_writes_fp8_rows(interleave: bool, name: str) -> None:
    check_mla_latent_quantized("cuda", name, interleave)


@pytest.mark.parametrize("case", EXPERT_CASES)
def test_fused_experts(case: tuple) -> None:
    print(case, check_experts("cuda", torch.bfloat16, *case))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_and_silu_mul(dtype: torch.dtype) -> None:
    check_combine("cuda", dtype)
    check_combine("cuda", dtype, t=4096, k=6, d=2048)
    check_silu_mul("cuda", dtype)
    check_silu_mul("cuda", dtype, n=3001, inter=96)


def test_routing_over_chunks_equals_one_program(monkeypatch: pytest.MonkeyPatch) -> None:
    check_route_split("cuda")
    monkeypatch.setattr(moe_routing, "ROUTE_SPLIT_ROWS", 256)  # the fused experts through it, 1,800 rows
    check_experts("cuda", torch.bfloat16, 300, 6, 64, 2048, 1408)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shared_slots_route_and_sum_as_widened_ids(dtype: torch.dtype) -> None:
    check_shared_slots("cuda", dtype)


def test_fused_experts_crowded_and_fp32() -> None:
    check_experts("cuda", torch.bfloat16, 100, 4, 16, 256, 128, crowd=True)  # 100 rows per used expert
    check_experts("cuda", torch.float32, 17, 6, 64, 256, 96)
    check_experts("cuda", torch.float32, 300, 6, 8, 512, 256)  # 64-row tiles in fp32 (shared memory)


def test_fused_experts_in_cuda_graph() -> None:
    check_experts_graph()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_experts_skip_ids_past_the_experts(dtype: torch.dtype) -> None:
    check_experts_skipped("cuda", dtype)


def test_moe_graph_path_under_ep_is_capturable_and_equals_eager() -> None:
    """An EP member's MoE in a graph's step (``static``: every gathered choice through the fused kernels, other
    ranks' skipped) equals its eager path (its own choices picked out on the host) and captures in a CUDA graph,
    whose replays on new inputs give the eager results; bf16 and block FP8 experts (the comm is the identity:
    this member's rows are the whole group's here, and the partial sums are its experts' alone)."""
    from engine_helpers import Alone

    from engine.config import ModelConfig
    from engine.layers import MoE
    from engine.parallel.expert_parallel import ExpertParallel, ExpertShard

    cfg = ModelConfig.from_dict({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 1000,
        "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "kv_lora_rank": 128, "q_lora_rank": None, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "scoring_func": "softmax"})
    torch.manual_seed(0)
    for fp8 in (False, True):
        for rank in (0, 1):
            moe = MoE(cfg, ExpertParallel(ExpertShard(rank, 2, 16), Alone()))
            for p in moe.parameters():
                p.data.normal_(0, 0.05)
            moe = moe.to(device="cuda", dtype=torch.bfloat16)
            moe.gate.float()
            if fp8:  # e4m3 experts, their block scales 1 (the weights are small); the shared MLP into its slots
                sh, s = moe.shared_experts, cfg.n_shared_experts
                w13 = torch.cat([moe.w13.data, torch.stack([torch.cat([g, u]) for g, u in zip(
                    sh.gate_proj.weight.chunk(s), sh.up_proj.weight.chunk(s))])])
                w2 = torch.cat([moe.w2.data, torch.stack(sh.down_proj.weight.chunk(s, dim=1))])
                moe.hold_fp8()
                assert moe.shared_slots == s
                moe.w13.data.copy_(w13.to(moe.w13.dtype))
                moe.w2.data.copy_(w2.to(moe.w2.dtype))
                moe.w13_scale_inv.data.fill_(1.0)
                moe.w2_scale_inv.data.fill_(1.0)
            x = torch.randn(24, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            counts = [24, 24]
            with torch.inference_mode():
                assert rel_err(moe(x, counts, static=True), moe(x, counts)) <= 2.0**-5, (fp8, rank)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = moe(x, counts, static=True)
                for _ in range(2):
                    x.copy_(torch.randn_like(x))
                    graph.replay()
                    torch.cuda.synchronize()
                    assert rel_err(out, moe(x, counts)) <= 2.0**-5, (fp8, rank)


def test_moe_module_fused_equals_grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE module through the fused kernels vs its grouped-GEMM / loop path, V2-Lite's expert shape."""
    from engine.config import ModelConfig
    from engine.layers import MoE

    cfg = ModelConfig.from_dict({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 1000,
        "hidden_size": 2048, "intermediate_size": 4096, "moe_intermediate_size": 1408, "num_hidden_layers": 2,
        "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "scoring_func": "softmax"})
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        p.data.normal_(0, 0.02)
    moe = moe.to(device="cuda", dtype=torch.bfloat16)
    moe.gate.float()
    for t in (1, 7, 64):
        x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        fused = moe(x)
        monkeypatch.setattr(moe_kernels, "HAS_TRITON", False)
        other = moe(x)
        monkeypatch.setattr(moe_kernels, "HAS_TRITON", True)
        assert rel_err(fused, other) <= 2.0**-5, f"T={t}: {rel_err(fused, other):.3g}"


if __name__ == "__main__":  # TRITON_INTERPRET=1: the same checks on CPU, small shapes
    for dt in (torch.float32, torch.float16):
        check_rms_norm("cpu", dt, d=96, t=5)
        for il in (True, False):
            check_mla_latent("cpu", dt, il, lat=64, rope_dim=16, heads=3, nope=32, t=4)
        for c in [(1, 6, 64, 64, 48), (5, 2, 8, 96, 40)]:
            print(dt, c, check_experts("cpu", dt, *c))
        check_combine("cpu", dt, t=5, k=3, d=40)
        check_route_split("cpu", ((1, 6, 64), (50, 6, 64), (40, 2, 8)))
        check_shared_slots("cpu", dt, ((1, 6, 64, 2), (50, 6, 64, 2), (40, 2, 8, 2), (90, 6, 16, 1), (9, 0, 8, 2)),
                           d=64, inter=32)
        check_experts_skipped("cpu", dt, t=9, k=3, d=64, inter=40)
        check_silu_mul("cpu", dt, n=7, inter=50)
        check_experts("cpu", dt, 40, 3, 8, 64, 32, crowd=True)
    print("ok")
