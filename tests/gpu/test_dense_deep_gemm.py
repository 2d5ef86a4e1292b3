"""Block-FP8 dense linears at prefill sizes through DeepGEMM (``engine.dense_deep_gemm``): the product equals the
same arithmetic in fp32 (the activations' e4m3 groups times the weight's blocks) on V2-Lite's and V3's dense
shapes, row counts that are not multiples of 4 included; a V2-Lite-shaped FP8 engine holds the copies, and its
prefill's hidden states are closer to those of the same engine doing the FP8 arithmetic in torch than that
arithmetic is to itself with each product moved by a bf16-sized difference (and stay within FP8's error of bf16
linears'). Skipped where DeepGEMM is not installed or the GPU is not sm90.

  TRITON_INTERPRET=1 PYTHONPATH=.:tests python tests/gpu/test_dense_deep_gemm.py   # the glue on CPU, DeepGEMM in torch
"""

from __future__ import annotations

import pytest
import torch

from engine import dense_deep_gemm, moe_deep_gemm
from engine.fp8 import dequantize_blocks, quantize_blocks
from engine.fp8_kernels import quantize_groups

pytestmark = pytest.mark.gpu
# (N, K): V2-Lite's q_proj, o_proj, kv_b_proj; V3's q_a_proj, q_b_proj, o_proj, dense MLP gate / down
SHAPES = [(3072, 2048), (2048, 2048), (4096, 512), (1536, 7168), (24576, 1536), (7168, 16384), (18432, 7168),
          (7168, 18432)]
# Norm error against the same arithmetic in fp32: bf16's rounding of the output (2^-9) and fp32 sums in another
# order. CPU (Triton's interpreter): its float-to-e4m3 conversion rounds differently from torch's (see
# test_moe_deep_gemm.py), so there the reference quantizes with the interpreter's own kernel.
TOLERANCE = 5e-3
# DeepGEMM's dense linears against the same FP8 arithmetic in torch, in an engine of 2 layers (dummy weights). Its
# products differ from that arithmetic by ~1.7e-3 (above), and these random weights amplify such differences
# through the layers: on an H100 DeepGEMM's engine was 1.7e-2 from the torch arithmetic's after layer 0 and 5.3e-2
# in the final states, evenly over the tokens; on CPU, moving each of the torch arithmetic's products by 1e-3
# (relative noise) moved them by 2.4e-2 and 5.4e-2, by 4e-3 3.3e-2 and 6.2e-2 (docs/benchmarks.md, fourteenth
# session): each next linear quantizes its input to e4m3, and any difference flips some of those roundings. So the
# bound is that measure, taken in the same run: DeepGEMM's engine stays closer to the torch arithmetic than the
# torch arithmetic with each product moved by PRODUCT_NOISE (layer 0, and the final states' median token). It
# catches wrong wiring (scales, layouts, the wrong weight: differences of order 1), not a product a few 1e-3 off:
# the e4m3 floor hides those, and the product tests above hold each product to TOLERANCE. The margins measured: 2x
# at layer 0, ~15% in the final states (H100 against CPU: `benchmarks/fp8_dense_sensitivity.py`).
PRODUCT_NOISE = 4e-3
# ... and against bf16 linears: FP8's own error, which these random weights amplify: 0.108 with the FP8 arithmetic
# in torch on CPU, 0.117-0.119 through DeepGEMM on an H100 (docs/benchmarks.md, thirteenth session).
ENGINE_FP8_ERROR = 0.2


def reference(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """(xq, xs) (x's e4m3 groups and scales) times the dequantized weight, in fp32."""
    m, k = x.shape
    act = (xq.float().view(m, k // 128, 128) * xs.float().unsqueeze(-1)).view(m, k)
    return act @ dequantize_blocks(w8, ws).T


class TorchDeepGEMM:
    """DeepGEMM's ``fp8_gemm_nt`` in torch, for the glue on CPU: checks the scales' layout DeepGEMM's sm90 kernels
    read (MN-major, rows padded to 4)."""

    @staticmethod
    def fp8_gemm_nt(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                    d: torch.Tensor) -> None:
        (q, sf), (w, ws) = a, b
        m = q.shape[0]
        assert sf.shape == (m, q.shape[1] // 128) and sf.stride(0) == 1 and sf.stride(1) == -(-m // 4) * 4
        d.copy_(reference(q, w, ws, q, sf).to(d.dtype))


def check(n: int, k: int, m: int, device: str = "cuda") -> float:
    g = torch.Generator(device=device).manual_seed(n + k + m)
    w8, ws = quantize_blocks(torch.randn(n, k, device=device, generator=g) * k**-0.5)
    x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
    got = dense_deep_gemm.linear(x, w8, ws)
    assert got is not None and got.shape == (m, n) and got.dtype == torch.bfloat16
    xq, xs = quantize_groups(x)  # the same per-token groups, row-major scales
    want = reference(x, w8, ws, xq, xs)
    err = float((got.float() - want).norm() / want.norm())
    print(f"N={n} K={k} M={m}: norm error {err:.2e}")
    return err


def _needs_deep_gemm() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    if moe_deep_gemm.library() is None:
        pytest.skip("DeepGEMM not installed (the deepgemm extra)")


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [2048, 4099])
def test_the_fp8_product_equals_the_same_arithmetic_in_fp32(n: int, k: int, m: int) -> None:
    _needs_deep_gemm()
    assert check(n, k, m) < TOLERANCE


def test_an_fp8_engine_holds_copies_and_its_prefill_is_the_fp8_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """V2-Lite's shape, 2 layers, dummy FP8 weights: the eligible linears hold copies (not kv_a_proj_with_mqa), a
    prefill of MIN_ROWS+ tokens takes them, and its hidden states (layer 0's, the final ones) are closer to those of
    the same engine whose copies multiply in torch (the same e4m3 groups times the dequantized weight, in fp32)
    than that engine's are to itself with each product moved by PRODUCT_NOISE; both stay within FP8's error of
    the bf16 linears'."""
    _needs_deep_gemm()
    monkeypatch.setenv("PDCLUSTER_DENSE_DEEP_GEMM", "1")
    import tempfile
    from pathlib import Path

    from engine import LLM, SamplingParams
    from pdctl.model_presets import preset_config
    from pdctl.tiny_model import write_config_only

    model = write_config_only(Path(tempfile.mkdtemp()) / "v2", preset_config("v2-lite", "fp8", num_layers=2))
    prompt = torch.randint(10, 1000, (dense_deep_gemm.MIN_ROWS + 100,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    calls: list[int] = []
    deep_gemm = dense_deep_gemm.linear

    def in_torch(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, noise: float = 0.0) -> torch.Tensor:
        xq, xs = quantize_groups(x)
        y = reference(x, w8, ws, xq, xs)
        if noise:  # each product moved by this much (relative), seeded
            y = y * (1 + noise * torch.randn(y.shape, device=y.device, generator=gen))
        return y.to(torch.bfloat16)

    gen = torch.Generator(device="cuda").manual_seed(0)

    def hidden_states(llm: LLM, linear) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """Layer 0's output and the final norm's, for the prompt."""
        monkeypatch.setattr(dense_deep_gemm, "linear", lambda *a: calls.append(a[0].shape[0]) or linear(*a))
        out: list[torch.Tensor] = []
        body = llm.engine.executor.model.model
        hooks = [m.register_forward_hook(lambda m, i, o: out.append(o.float())) for m in (body.layers["0"], body.norm)]
        try:
            llm.generate([prompt.tolist()], params)
        finally:
            for h in hooks:
                h.remove()
        return out[0], out[1]

    with LLM(str(model), load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=8192,
             max_num_batched_tokens=8192, enforce_eager=True, enable_prefix_caching=False) as llm:
        mods = dict(llm.engine.executor.model.named_modules())
        held = [n for n, m in mods.items() if isinstance(m, dense_deep_gemm.PrefillFp8Linear)]
        assert held and all(n.endswith(("q_proj", "kv_b_proj", "o_proj")) for n in held), held
        assert not isinstance(mods["model.layers.0.self_attn.kv_a_proj_with_mqa"], dense_deep_gemm.PrefillFp8Linear)
        got0, got = hidden_states(llm, deep_gemm)
        assert calls and min(calls) >= dense_deep_gemm.MIN_ROWS, calls  # the prefill took the copies
        want0, want = hidden_states(llm, in_torch)
        moved0, moved = hidden_states(llm, lambda *a: in_torch(*a, noise=PRODUCT_NOISE))
        monkeypatch.setattr(dense_deep_gemm, "MIN_ROWS", 1 << 30)  # the same engine, bf16 linears
        n_calls = len(calls)
        _, bf16 = hidden_states(llm, deep_gemm)
        assert len(calls) == n_calls
    assert got.shape == want.shape == bf16.shape == got0.shape == moved.shape == (len(prompt), 2048)

    def apart(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    def median_token(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).median())

    fp8_err = apart(got, bf16)
    print(f"from the FP8 arithmetic in torch: DeepGEMM layer 0 {apart(got0, want0):.2e}, final {apart(got, want):.2e} "
          f"(median token {median_token(got, want):.2e}); products moved by {PRODUCT_NOISE:.0e}: layer 0 "
          f"{apart(moved0, want0):.2e}, final {apart(moved, want):.2e} (median token {median_token(moved, want):.2e});"
          f" DeepGEMM from bf16 linears {fp8_err:.2e}")
    assert apart(got0, want0) < apart(moved0, want0)
    assert median_token(got, want) < median_token(moved, want)
    assert 0 < fp8_err < ENGINE_FP8_ERROR


if __name__ == "__main__":  # TRITON_INTERPRET=1: the glue on CPU, small shapes
    moe_deep_gemm.library = lambda: TorchDeepGEMM  # type: ignore[assignment]
    for n, k, m in [(256, 256, 5), (128, 384, 8), (384, 128, 13)]:
        assert check(n, k, m, "cpu") < 5e-2
    print("ok")
