"""FlashMLA's FP8 decode (``engine.mla_decode_flashmla``) behind ``mla_decode`` for ``fp8`` caches of 64-token
blocks: against the fp32 reference on ragged paged caches (1 to 32k tokens, padding rows), beside our Triton
kernel's error on the same case; a CUDA graph's replay equal to the eager call. Skipped without the package
(``bash scripts/gpu_carry.sh flashmla``) or off sm90.

Tolerance: FlashMLA rounds the queries (one scale a call) and the softmax's probabilities to e4m3 as well, so
it errs more than our kernel, which dequantizes the rows and multiplies in fp16 (TOL below, measured).
"""

from __future__ import annotations

import pytest
import torch
from test_mla_decode import SCALE, quantized_case, ragged_lens

from engine import mla_decode_flashmla
from engine.mla_decode import mla_decode, mla_decode_reference

pytestmark = pytest.mark.gpu
# max |out - ref| / max |ref|, and the norm error |out - ref| / |ref|
TOL = (6e-2, 4.5e-2)  # above the errors measured (docs/benchmarks.md)
CONFIGS = [(16, 1, 32768), (16, 8, 4096), (16, 64, 8192), (16, 256, 1024), (128, 8, 32768)]  # heads, batch, max len


@pytest.fixture
def flashmla() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FlashMLA's dense FP8 decode runs on sm90")
    if mla_decode_flashmla._ops() is None:
        pytest.skip("FlashMLA not installed (scripts/gpu_carry.sh flashmla) or turned off (PDCLUSTER_FLASHMLA=0)")


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = got.float() - ref
    return float(diff.abs().max() / ref.abs().max()), float(diff.norm() / ref.norm())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "H{}-B{}-len{}".format(*c))
def test_flashmla_fp8_decode_matches_the_reference(flashmla: None, config: tuple[int, int, int],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    heads, batch, max_len = config
    case, fmt = quantized_case("fp8", ragged_lens(batch, max_len, 64, seed=batch), heads, 64, torch.bfloat16,
                               "cuda", seed=batch)
    ref, _ = mla_decode_reference(**case, scale=SCALE, kv_format=fmt)
    calls: list[int] = []
    real = mla_decode_flashmla.decode
    monkeypatch.setattr(mla_decode_flashmla, "decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got, lse = mla_decode(**case, scale=SCALE, kv_format=fmt)
    assert calls and lse is None, "mla_decode did not hand the fp8 call to FlashMLA"
    with monkeypatch.context() as m:
        m.setattr(mla_decode_flashmla, "usable", lambda *a: False)
        ours, _ = mla_decode(**case, scale=SCALE, kv_format=fmt)
    err, ours_err = _errors(got, ref), _errors(ours, ref)
    print(f"H={heads} B={batch} max_len={max_len}: FlashMLA max {err[0]:.2e} norm {err[1]:.2e}; "
          f"ours max {ours_err[0]:.2e} norm {ours_err[1]:.2e}")
    assert got.shape == ref.shape and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert (got[case["seq_lens"] == 0] == 0).all(), "seq_len-0 rows must be zeros"
    assert err[0] < TOL[0] and err[1] < TOL[1], err

    out = torch.empty_like(got)
    mla_decode(**case, scale=SCALE, kv_format=fmt, out=out)  # warm: nothing compiled or allocated first in capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(**case, scale=SCALE, kv_format=fmt, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def test_other_calls_keep_the_triton_kernel(flashmla: None) -> None:
    """An lse asked for, 16-token blocks or a bf16 cache: not FlashMLA's."""
    case, fmt = quantized_case("fp8", [100, 7], 16, 64, torch.bfloat16, "cuda")
    assert mla_decode_flashmla.usable(case["q_lat"], case["q_pe"], case["kv_cache"], fmt, False)
    assert not mla_decode_flashmla.usable(case["q_lat"], case["q_pe"], case["kv_cache"], fmt, True)
    assert not mla_decode_flashmla.usable(case["q_lat"], case["q_pe"], case["kv_cache"], None, False)
    small, fmt16 = quantized_case("fp8", [100, 7], 16, 16, torch.bfloat16, "cuda")
    assert not mla_decode_flashmla.usable(small["q_lat"], small["q_pe"], small["kv_cache"], fmt16, False)


@pytest.mark.parametrize("batch", [1, 64, 256])
def test_the_query_quantizer_matches_torch(batch: int) -> None:
    """``quantize_query``'s two Triton launches give torch's e4m3 rounding of q / (amax / 448), bit for bit, on
    q_pe as the engine hands it (a strided view)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(batch)
    q_lat = torch.randn(batch, 16, 512, device="cuda", generator=g).to(torch.bfloat16)
    q_pe = (torch.randn(batch, 16, 192, device="cuda", generator=g) * 3).to(torch.bfloat16)[..., 128:]
    q8, scale = mla_decode_flashmla.quantize_query(q_lat, q_pe)
    q = torch.cat((q_lat, q_pe), dim=-1).float()
    want_scale = q.abs().amax() / 448.0
    assert q8.shape == (batch, 1, 16, 576) and torch.equal(scale, want_scale.reshape(1))
    assert torch.equal(q8.view(torch.uint8), (q / want_scale).to(q8.dtype).unsqueeze(1).view(torch.uint8))


def test_a_batch_of_empty_rows_gives_zeros(flashmla: None) -> None:
    """Every row of length 0, as while a graph is captured: zeros (FlashMLA itself faults on such a batch)."""
    case, fmt = quantized_case("fp8", [0] * 8, 16, 64, torch.bfloat16, "cuda")
    got, _ = mla_decode(**case, scale=SCALE, kv_format=fmt)
    torch.cuda.synchronize()
    assert torch.equal(got, torch.zeros_like(got))


def test_the_engine_decodes_through_flashmla_as_close_to_fp32_as_through_ours(flashmla: None, tmp_path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine on a tiny model with FlashMLA's latent shape (512 + 64, 16 heads), fp8 KV in 64-token
    blocks, eager and from graphs: FlashMLA serves its decode steps (every layer's call, the schedule made once a
    step) and follows the fp32 CPU engine with the same cache format about as far as our kernel does, with the
    same bound on the logprob error as tests/gpu/test_fp8_kv_gpu.py's, loosened for FlashMLA's e4m3 queries."""
    from test_cuda_graphs import KW, _requests
    from test_fp8_kv_gpu import _follow

    from engine import LLM
    from pdctl.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "m", overrides={"num_attention_heads": 16}, seed=5)  # latents of 512 + 64
    prompts, params = _requests()
    kw = {**KW, "kv_cache_dtype": "fp8", "block_size": 64}
    with LLM(str(model), **{**kw, "device": "cpu", "dtype": "float32"}) as cpu:
        ref = cpu.generate(prompts, params)
    calls: list[int] = []
    real = mla_decode_flashmla.decode
    monkeypatch.setattr(mla_decode_flashmla, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    follows = {}
    for kernel in ("flashmla", "ours"):
        with monkeypatch.context() as m:
            if kernel == "ours":
                m.setattr(mla_decode_flashmla, "usable", lambda *a: False)
            for mode, over in (("eager", {"enforce_eager": True}), ("graph", {})):
                calls.clear()
                with LLM(str(model), **kw, **over) as llm:
                    got = llm.generate(prompts, params)
                    graphs = llm.engine.executor.graphs
                    assert (graphs is None) == (mode == "eager") and (graphs is None or graphs.replays > 20)
                    assert llm.engine.num_used_blocks == 0
                assert bool(calls) == (kernel == "flashmla"), (kernel, mode, len(calls))  # (graphs: their captures)
                follows[kernel, mode] = _follow(ref, got)
    print(follows)
    for mode in ("eager", "graph"):
        n_ours, err_ours = follows["ours", mode]
        n, err = follows["flashmla", mode]
        assert n >= 0.5 * n_ours > 0, follows
        assert err <= 2 * err_ours + 0.1, follows
