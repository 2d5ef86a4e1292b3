"""Compile the MLA decode kernel for Hopper (sm_90) on a machine without a GPU and say how its dots read their
operands: the dot operands' ``kWidth`` in the TTGIR and the shared-memory and shuffle instructions in the PTX,
for bf16 rows and for each fp8 variant. Needs a Triton with the NVIDIA backend (the GPU machine's is 3.6; for
another version install its wheel into a directory and put it first on PYTHONPATH).

    python3 scripts/mla_decode_ir.py [--out DIR]      # e.g. /opt/vllm-venv/bin/python here

Nsight Compute showed the fp8 kernel bound by shared memory (docs/benchmarks.md, 2026-12-06): this is the
static half of that picture, which needs no device time.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import mla_decode  # noqa: E402

# (name, FMT, ODT, CVT, OPQ): the kernel's constexprs (engine/mla_decode.py) for each way of reading rows
VARIANTS = [("bf16", 0, 0, 0, 0), ("fp8 fp16-dots ptx", 1, 1, 2, 0), ("fp8 fp16-dots ptx opaque", 1, 1, 2, 1),
            ("fp8 fp16-dots bits", 1, 1, 1, 0), ("fp8 fp16-dots compiler", 1, 1, 0, 0),
            ("fp8 dequant ptx", 1, 0, 2, 0), ("fp8 dequant ptx opaque", 1, 0, 2, 1),
            ("fp8_ds_mla ptx", 2, 0, 2, 0), ("fp8_ds_mla ptx opaque", 2, 0, 2, 1)]
POINTERS = {"QL": "*bf16", "QP": "*bf16", "BT": "*i32", "LENS": "*i32", "GROUPED": "*i32", "OUT": "*bf16",
            "LSE": "*bf16", "POUT": "*fp32", "PLSE": "*fp32", "scale_log2": "fp32", "kv_scale": "fp32"}


def compile_variant(fmt: int, odt: int, cvt: int, opq: int, warps: int, stages: int) -> triton.compiler.CompiledKernel:
    """The split kernel as the decode launch compiles it for 16 heads (V2-Lite), 32-token tiles, 8 splits."""
    fn = mla_decode._mla_decode_split
    const = dict(L=512, R=64, BL=512, BR=64, PAGE=64, BH=16, BN=mla_decode.BLOCK_N, SPLITS=8, WS=8, HAS_LSE=False,
                 PREC="tf32", G=1, MODE=0, FMT=fmt, ODT=odt, CVT=cvt, OPQ=opq)
    sig = {n: "constexpr" if n in const else POINTERS.get(n, "i32") for n in fn.arg_names}
    sig["KV"] = "*u8" if fmt else "*bf16"
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write each variant's TTGIR and PTX here")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90")
    for name, fmt, odt, cvt, opq in VARIANTS:
        k = compile_variant(fmt, odt, cvt, opq, warps=4, stages=3)
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        widths = sorted(set(re.findall(r"kWidth = (\d+)", ttgir)))
        counts = {op: len(re.findall(pat, ptx)) for op, pat in (
            ("ldmatrix", r"\bldmatrix"), ("stmatrix", r"\bstmatrix"), ("ld.shared", r"\bld\.shared"),
            ("st.shared", r"\bst\.shared"), ("shfl", r"\bshfl"), ("mma", r"\bmma\.sync"))}
        print(f"{name:26s} kWidth {','.join(widths):4s} shared {k.metadata.shared:6d} B  "
              + "  ".join(f"{op} {n}" for op, n in counts.items()), flush=True)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            slug = name.replace(" ", "_")
            (a.out / f"{slug}.ttgir").write_text(ttgir)
            (a.out / f"{slug}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
