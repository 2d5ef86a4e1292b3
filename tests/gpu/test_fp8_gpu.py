"""Block-FP8 compute (W8A8) on the GPU: the dense GEMM and the fused routed experts against the bf16 product
of the dequantized weights on V2-Lite and V3 shapes, eager and replayed from a CUDA graph; and an FP8
checkpoint served in FP8 against its dequantized twin on the fp32 CPU engine.

Tolerances: e4m3 keeps 3 mantissa bits, so quantizing the activations moves each value by up to 2^-4 of
itself; over a K-long dot product those errors mostly cancel. Against the dequantized-weight bf16 product
the FP8 result stays within 5% of the output's largest magnitude (measured ~1-2%, printed); against the
same arithmetic in fp32 (the activations, and the experts' hidden activations, quantized as the kernels do) the
dense GEMM stays within 1% of that largest magnitude (``reference_linear``) and the experts within 0.6% as a norm
(``fused_experts_reference_fp8``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import fp8_experts

from engine import LLM, SamplingParams, fp8_kernels, moe_kernels
from engine.fp8 import FP8_DTYPE, dequantize_blocks, quantize_blocks

pytestmark = pytest.mark.gpu
# (N, K): V2-Lite's q_proj, kv_a_proj_with_mqa, dense down_proj; V3's q_b_proj and o_proj
LINEARS = [(3072, 2048), (576, 2048), (2048, 10944), (24576, 1536), (7168, 16384)]
# (experts, hidden, moe_intermediate, top-k): V2-Lite's and V3's routed experts
EXPERTS = [(64, 2048, 1408, 6), (256, 7168, 2048, 8)]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def _replayed(fn, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """fn(x) captured in a CUDA graph on other values, then replayed on x's."""
    static = torch.randn_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(static)
    static.copy_(x)
    g.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("n,k", LINEARS)
def test_fp8_linear_matches_the_dequantized_bf16_product(n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    wq, ws = quantize_blocks(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
    wd = dequantize_blocks(wq, ws, dtype=torch.bfloat16)
    for m in (1, 7, 64, 300, 2048):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        got = fp8_kernels.linear(x, wq, ws)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        exact, ref = _rel(got, fp8_kernels.reference_linear(x, wq, ws)), _rel(got, F.linear(x, wd))
        print(f"N={n} K={k} M={m}: vs same-arithmetic fp32 {exact:.2e}, vs dequantized bf16 {ref:.2e}")
        assert exact < 1e-2 and ref < 5e-2, (m, exact, ref)
        if m in (7, 300):
            replayed = _replayed(lambda x: fp8_kernels.linear(x, wq, ws), x)
            assert torch.equal(replayed, got)


def _experts_reference(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """[T, K, D] in fp32 from the dequantized weights, one expert at a time."""
    t, k = ids.shape
    i = w13.shape[1] // 2
    out = torch.zeros(t * k, x.shape[1], device=x.device)
    flat = ids.flatten()
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero().squeeze(1)
        h = x[rows // k].float() @ w13[e].float().T
        out[rows] = (F.silu(h[:, :i]) * h[:, i:]).to(x.dtype).float() @ w2[e].float().T
    return out.view(t, k, -1)


@pytest.mark.parametrize("tma_rows", [None, 0.0, float("inf")], ids=["default", "tma-form", "fused-form"])
@pytest.mark.parametrize("shape", EXPERTS, ids=["v2-lite", "v3"])
def test_fp8_experts_match_the_dequantized_bf16_experts(shape: tuple[int, int, int, int], tma_rows: float | None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both forms of the FP8 experts (fused; TMA-fed, prefill sizes on Hopper) at every size, and the engine's
    choice between them."""
    if tma_rows is not None:
        monkeypatch.setattr(moe_kernels, "FP8_TMA_MIN_ROWS", tma_rows)
    if tma_rows == 0.0 and not moe_kernels.tma_form(torch.empty(1, device="cuda"), 1, 1, 16, 16):
        pytest.skip("no TMA form here (Triton without host tensor descriptors, or before Hopper)")
    e, d, i, top = shape
    g = torch.Generator(device="cuda").manual_seed(e)
    w13q, w13s, w2q, w2s, w13d, w2d = fp8_experts(e, d, i, g)
    for t in (1, 64, 300, 2000, 4096):  # from 2000 tokens: above MAX_ROWS rows, where bf16 takes the grouped GEMM
        x = torch.randn(t, d, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :top].contiguous()
        got = moe_kernels.fused_experts(x, ids, w13q, w2q, w13s, w2s)
        err = _rel(got, _experts_reference(x, ids, w13d, w2d))
        same = moe_kernels.fused_experts_reference_fp8(x, ids, w13q, w2q, w13s, w2s) if t <= 300 else got.float()
        exact = float((got.float() - same).norm() / same.norm())
        print(f"experts {shape} T={t} tma_rows={tma_rows}: vs dequantized bf16 {err:.2e}, vs same-arithmetic fp32 "
              f"{exact:.2e}")
        # Against the same arithmetic (as a norm): the tensor cores' FP8 sums are not fp32's (wgmma sums each
        # 128-block's products in reduced precision before the fp32 add), and where a hidden activation lies at an
        # e4m3 rounding boundary it rounds the other way: 0.17-0.38% measured (H100); sums that drift over the
        # whole row instead of being promoted per block (FP8_TMA_PROMOTE off) err by 1.0-1.5%.
        assert got.shape == (t, top, d) and err < 5e-2 and exact < 6e-3, (t, err, exact)
        if t == 64:
            replayed = _replayed(lambda x, ids=ids: moe_kernels.fused_experts(x, ids, w13q, w2q, w13s, w2s), x)
            assert torch.equal(replayed, got)
        if t == 2000:  # choices past the experts (expert parallelism's graphs) skipped, the rest as before
            skip = torch.rand(t, top, device="cuda", generator=g) < 0.5
            got = moe_kernels.fused_experts(x, torch.where(skip, e, ids), w13q, w2q, w13s, w2s)
            ref = _experts_reference(x, ids, w13d, w2d)
            assert _rel(got[~skip], ref[~skip]) < 5e-2


def test_fp8_moe_layers_with_shared_slots_match_the_dequantized_layers(fp8_model) -> None:
    """Each MoE layer of the FP8 checkpoint held on the GPU (routed experts and the shared experts' slots in
    FP8: ``MoE.hold_fp8``) against the dequantized twin's bf16 layer (a separate shared MLP), eager and from a
    CUDA graph, from 1 to 300 tokens (the fused and the TMA-fed forms)."""
    from engine.config import ModelConfig
    from engine.layers import MoE
    from engine.weights import build_empty_model, load_weights

    fp8, twin = fp8_model
    dev = torch.device("cuda")
    held = build_empty_model(ModelConfig.from_pretrained(fp8), torch.bfloat16, dev)
    load_weights(held, fp8)
    ref = build_empty_model(ModelConfig.from_pretrained(twin), torch.bfloat16, dev)
    load_weights(ref, twin)
    g = torch.Generator(device="cuda").manual_seed(3)
    for i, layer in held.model.layers.items():
        moe = layer.mlp
        if not isinstance(moe, MoE):
            continue
        assert moe.shared_slots == held.cfg.n_shared_experts and moe.shared_experts is None
        for t in (1, 64, 300):
            x = torch.randn(t, held.cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
            want = ref.model.layers[i].mlp(x)
            assert _rel(moe(x), want) < 5e-2
            assert _rel(_replayed(lambda v, moe=moe: moe(v, static=True), x), want) < 5e-2


def test_fp8_shared_slots_under_expert_parallelism(fp8_model) -> None:
    """An FP8 MoE layer holding half the routed experts (EP rank 0 of 2) and the shared slots, eager and in
    graph form (every choice passed, other ranks' skipped), equals the same kernels over its stack with the
    other rank's choices weighted 0: the shared experts run on the rank's own rows, in FP8, as without EP."""
    from engine_helpers import Alone

    from engine.config import ModelConfig
    from engine.layers import MoE
    from engine.parallel.expert_parallel import ExpertParallel, ExpertShard

    cfg = ModelConfig.from_pretrained(fp8_model[0])
    e, s, i, d = cfg.n_routed_experts, cfg.n_shared_experts, cfg.moe_intermediate_size, cfg.hidden_size
    with torch.device("meta"):
        moe = MoE(cfg, ExpertParallel(ExpertShard(0, 2, e), Alone()))
        moe.hold_fp8()
    moe = moe.to_empty(device="cuda").requires_grad_(False)
    assert (moe.routed, moe.shared_slots, moe.w13.shape[0]) == (e // 2, s, e // 2 + s)
    g = torch.Generator(device="cuda").manual_seed(4)
    moe.gate.weight.normal_(generator=g)
    for j in range(moe.w13.shape[0]):
        for h in range(2):
            q, sc = quantize_blocks(torch.randn(i, d, device="cuda", generator=g) / d**0.5)
            moe.w13[j, h * i:(h + 1) * i] = q
            moe.w13_scale_inv[j].chunk(2)[h].copy_(sc)
        moe.w2[j], moe.w2_scale_inv[j] = quantize_blocks(torch.randn(d, i, device="cuda", generator=g) / i**0.5)
    for t in (1, 13, 300):
        x = torch.randn(t, d, device="cuda", generator=g)
        w, ids = moe.gate(x)
        mine = ids < moe.routed
        want = moe_kernels.combine(moe_kernels.fused_experts(
            x, torch.where(mine, ids, 0), moe.w13, moe.w2, moe.w13_scale_inv, moe.w2_scale_inv, shared=s),
            torch.where(mine, w, 0.0), slots=s)
        for static in (False, True):
            # Not bit for bit: the EP rank's launches see other row counts, so other tiles (and MMA instructions)
            # sum the same products in another order, and where a hidden activation lies at an e4m3 rounding
            # boundary it rounds the other way (4e-3 measured on an H200); leaving the slots out errs by ~0.5.
            err = _rel(moe(x, ep_counts=[t, 0], static=static), want)
            print(f"EP rank 0, {t} tokens, static {static}: {err:.2e}")
            assert err < 1e-2, (t, static)


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_an_fp8_checkpoint_computes_in_fp8_as_close_to_its_twin_as_bf16(fp8_model) -> None:
    """The FP8 checkpoint on the GPU holds its routed experts in FP8 (the rest dequantized) and, eager and from
    CUDA graphs, follows the fp32 CPU engine on the dequantized twin's greedy tokens; the twin itself in bf16
    on the GPU is the yardstick (W8A8 also rounds the activations, so the FP8 run may part sooner)."""
    from engine.layers import MoE

    fp8, twin = fp8_model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (5, 40, 130, 300, 17, 64)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True)
    kw = dict(dtype="bfloat16", device="cuda", max_model_len=1024, gpu_memory_utilization=0.3,
              max_cudagraph_capture_size=8, max_num_batched_tokens=128)
    with LLM(str(twin), dtype="float32", device="cpu", max_model_len=1024) as cpu:
        ref = cpu.generate(prompts, params)
    follows = {}
    for name, path, over in (("bf16", twin, {}), ("fp8-eager", fp8, {"enforce_eager": True}), ("fp8-graph", fp8, {})):
        with LLM(str(path), **kw, **over) as llm:
            model = llm.engine.model
            mods = list(model.modules())
            if name.startswith("fp8"):
                moes = [m for m in mods if isinstance(m, MoE)]
                assert moes and all(m.w13.dtype == m.w2.dtype == FP8_DTYPE for m in moes)
                assert model.model.layers["0"].self_attn.o_proj.weight.dtype == torch.bfloat16
            got = llm.generate(prompts, params)
            if name == "fp8-graph":
                assert llm.engine.executor.graphs is not None and llm.engine.executor.graphs.replays > 10
            assert llm.engine.num_used_blocks == 0
        follows[name] = sum(_first_diff(r.token_ids, o.token_ids) for r, o in zip(ref, got))
    print(follows)
    total = sum(len(r.token_ids) for r in ref)
    assert follows["bf16"] > 0.5 * total, follows
    # Measured on an H200: bf16 98 of 144 tokens, fp8 eager 63, fp8 graph 39 (W8A8 rounds every expert's
    # input and hidden activations to e4m3, so this random tiny model's near-tied greedy choices part sooner;
    # the kernels' own error is bounded above). A broken FP8 path follows none.
    assert follows["fp8-eager"] >= 0.25 * follows["bf16"] and follows["fp8-graph"] >= 0.25 * follows["bf16"], follows
