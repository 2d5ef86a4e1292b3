"""The native engine on a CUDA GPU in bf16 against the fp32 CPU engine (flash attention paths)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import set_decode_form

from engine import LLM

pytestmark = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 900, (n,), generator=g).tolist() for n in (600, 7, 65)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


def test_bf16_gpu_matches_fp32_cpu(tiny_model) -> None:
    prompts = _prompts()
    with LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=1024) as cpu:
        ref = cpu.prompt_logits(prompts)
    # Chunks of 64 exercise the flash-attention log-sum-exp merge of context and new tokens.
    for budget in (2048, 64):
        with LLM(str(tiny_model), dtype="bfloat16", device="cuda", max_model_len=1024,
                 max_num_batched_tokens=budget, gpu_memory_utilization=0.3) as gpu:
            got = gpu.prompt_logits(prompts)
        for r, o in zip(ref, got):
            assert _rel(o, r) < 2e-2, (budget, _rel(o, r))


def test_absorbed_equals_decompressed_on_gpu(tiny_model) -> None:
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1)
    outs = {}
    for form in ("absorbed", "decompressed"):
        with LLM(str(tiny_model), dtype="float32", device="cuda", max_model_len=1024,
                 gpu_memory_utilization=0.3) as llm:
            set_decode_form(llm.engine.model, form)
            outs[form] = llm.generate(_prompts(), sp)
    for a, b in zip(outs["absorbed"], outs["decompressed"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def test_grouped_gemm_moe_equals_expert_loop(tiny_model) -> None:
    from engine.config import ModelConfig
    from engine.layers import MoE, _use_grouped_mm

    cfg = ModelConfig.from_pretrained(tiny_model)
    torch.manual_seed(0)
    moe = MoE(cfg).to("cuda", torch.bfloat16)
    for p in moe.parameters():
        p.data.normal_(0, 0.05)
    x = torch.randn(300, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert _use_grouped_mm(x)
    _, ids = moe.gate(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    xs = x[order // ids.shape[1]]
    counts = torch.bincount(flat, minlength=moe.w13.shape[0])
    grouped, loop = moe._experts_grouped(xs, counts), moe._experts_loop(xs, counts)
    assert _rel(grouped.float(), loop.float()) < 1e-2


def test_pcp_local_attention_flash_path_matches_fp64() -> None:
    from engine.attention_ops import attention_lse
    from engine.parallel.pcp_attention import contiguous_runs, pcp_local_attention
    from engine.parallel.pcp_split import zigzag_indices

    n, pcp, h = 4099, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(n, h, 192, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(n, h, 128, generator=g, dtype=torch.float64)
    ref, _ = attention_lse(q, k, v, 0.07, causal=True)
    out = torch.empty(n, h, 128, dtype=torch.float64)
    qb, kb, vb = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    for r in range(pcp):
        idx = zigzag_indices(n, pcp, r)
        o, _ = pcp_local_attention(qb[idx], contiguous_runs(idx), kb, vb, 0.07)
        out[idx] = o.double().cpu()
    assert _rel(out, ref) < 1e-2


def test_prompt_attention_padded_to_a_cudnn_bucket_matches_fp64(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attention_ops.CUDNN_BUCKET``: a causal prompt padded to a bucket's rows on cuDNN gives its rows'
    attention (the padding keys come after every real query), at lengths off and on a bucket's edge."""
    from engine import attention_ops
    from engine.attention_ops import attention

    monkeypatch.setattr(attention_ops, "CUDNN_BUCKET", 512)
    monkeypatch.setattr(attention_ops, "CUDNN_BUCKET_MIN_ROWS", 1024)
    called = []
    real = attention_ops._cudnn_bucketed
    monkeypatch.setattr(attention_ops, "_cudnn_bucketed", lambda *a: called.append(a[0].shape[0]) or real(*a))
    h = 16
    g = torch.Generator().manual_seed(2)
    for n in (1025, 1536, 2000):
        q, k = (torch.randn(n, h, 192, generator=g, dtype=torch.float64) for _ in range(2))
        v = torch.randn(n, h, 128, generator=g, dtype=torch.float64)
        ref = attention(q, k, v, 0.07, causal=True)
        out = attention(*(t.to("cuda", torch.bfloat16) for t in (q, k, v)), 0.07, causal=True)
        assert out.shape == (n, h, 128)
        assert _rel(out.double().cpu(), ref) < 1e-2, n
    assert called == [1025, 1536, 2000]
    assert attention_ops.warm_cudnn_buckets(h, 192, 128, 2000, torch.bfloat16, torch.device("cuda")) == 3


def test_new_rows_over_a_context_in_one_flash_call_match_fp64() -> None:
    """``attention`` with fewer queries than keys, causal: FlashAttention aligns the mask bottom-right (the
    queries are the last rows), as the fp64 reference does; the joint context path relies on it."""
    from engine.attention_ops import attention

    h = 16
    g = torch.Generator().manual_seed(1)
    for s, ctx in ((1, 64), (37, 500), (300, 2048)):
        q = torch.randn(s, h, 192, generator=g, dtype=torch.float64)
        k = torch.randn(ctx + s, h, 192, generator=g, dtype=torch.float64)
        v = torch.randn(ctx + s, h, 128, generator=g, dtype=torch.float64)
        ref = attention(q, k, v, 0.07, causal=True)
        out = attention(*(t.to("cuda", torch.bfloat16) for t in (q, k, v)), 0.07, causal=True)
        assert _rel(out.double().cpu(), ref) < 1e-2, (s, ctx)
