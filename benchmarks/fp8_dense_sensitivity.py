"""How far a dummy FP8 model's layers carry a small difference in each dense FP8 product: the bound behind
tests/gpu/test_dense_deep_gemm.py's engine test.

A V2-Lite-shaped engine of ``--layers`` layers with dummy block-FP8 weights prefills one ``--tokens``-token prompt
with its dense linears' FP8 copies (``engine.dense_deep_gemm``) multiplied in torch: the activations in e4m3
groups of 128 times the dequantized weight, in fp32, rounded to bf16. Then again with each product moved by
relative Gaussian noise (times 1 + eps N(0, 1)) for each ``--noise`` eps. It prints how far that moves layer 0's
output and the final norm's (whole, and per token). Runs where the engine runs (CPU included: DeepGEMM itself is
not used). Ends with one JSON line.

  python benchmarks/fp8_dense_sensitivity.py                        # 2 layers, 4,196 tokens, eps 1e-3 2e-3 4e-3
  python benchmarks/fp8_dense_sensitivity.py --tokens 512 --noise 1e-3   # quicker
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams, dense_deep_gemm  # noqa: E402
from engine.fp8_kernels import reference_linear  # noqa: E402
from pdctl.model_presets import preset_config  # noqa: E402
from pdctl.tiny_model import write_config_only  # noqa: E402


class Products:
    """``dense_deep_gemm.linear`` in torch, each product moved by ``eps`` (seeded, a new draw each call)."""

    def __init__(self) -> None:
        self.eps = 0.0
        self.gen = torch.Generator().manual_seed(0)

    def __call__(self, x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        y = reference_linear(x, w8, w_scale)  # the e4m3 groups times the dequantized weight, in fp32
        if self.eps:
            y = y * (1 + self.eps * torch.randn(y.shape, generator=self.gen).to(y.device))
        return y.to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=dense_deep_gemm.MIN_ROWS + 100)
    ap.add_argument("--noise", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    products = Products()
    dense_deep_gemm.usable = lambda device: True  # type: ignore[assignment]  # the copies, anywhere
    dense_deep_gemm.linear = products  # type: ignore[assignment]
    dense_deep_gemm.warm_up = lambda model, rows: 0  # type: ignore[assignment]
    dense_deep_gemm.MIN_ROWS = min(dense_deep_gemm.MIN_ROWS, args.tokens)
    model = write_config_only(Path(tempfile.mkdtemp()) / "v2", preset_config("v2-lite", "fp8", num_layers=args.layers))
    prompt = torch.randint(10, 1000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    with LLM(str(model), load_format="dummy", dtype="bfloat16", device=args.device, max_model_len=args.tokens + 8,
             max_num_batched_tokens=args.tokens + 8, enforce_eager=True, enable_prefix_caching=False) as llm:
        body = llm.engine.executor.model.model
        held = sum(isinstance(m, dense_deep_gemm.PrefillFp8Linear) for m in body.modules())

        def states() -> tuple[torch.Tensor, torch.Tensor]:
            out: list[torch.Tensor] = []
            hooks = [m.register_forward_hook(lambda m, i, o: out.append(o.float().cpu()))
                     for m in (body.layers["0"], body.norm)]
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
            for h in hooks:
                h.remove()
            print(f"  prefill {time.perf_counter() - t0:.1f} s", flush=True)
            return out[0], out[1]

        base0, base = states()
        for eps in args.noise:
            products.eps = eps
            got0, got = states()
            per_token = (got - base).norm(dim=-1) / base.norm(dim=-1)
            row = {"eps": eps, "layer0": float((got0 - base0).norm() / base0.norm()),
                   "final": float((got - base).norm() / base.norm()), "median_token": float(per_token.median()),
                   "worst_token": float(per_token.max())}
            rows.append(row)
            print(f"eps {eps:.0e}: layer 0 {row['layer0']:.2e}; final {row['final']:.2e}, median token "
                  f"{row['median_token']:.2e}, worst {row['worst_token']:.2e}", flush=True)
    print(json.dumps({"benchmark": "fp8_dense_sensitivity", "layers": args.layers, "tokens": args.tokens,
                      "device": args.device, "linears_with_copies": held, "rows": rows}))


if __name__ == "__main__":
    main()
