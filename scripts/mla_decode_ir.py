"""Compile the MLA decode kernel for Hopper (sm_90) on a machine without a GPU and say how its dots read their
operands: the dot operands' ``kWidth`` in the TTGIR and the shared-memory and shuffle instructions in the PTX,
for bf16 rows and for each fp8 variant, and the registers a thread and bytes spilled, by the ptxas Triton ships.
Needs a Triton with the NVIDIA backend (the GPU machine's is 3.6; for another version install its wheel into a
directory and put it first on PYTHONPATH).

    python3 scripts/mla_decode_ir.py [--out DIR] [--maxnreg N]

Nsight Compute showed the fp8 kernel bound by shared memory (docs/benchmarks.md, 2026-12-06): this is the
static half of that picture, which needs no device time.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
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


def registers(ptx: str) -> str:
    """Registers a thread and spilled bytes, by the ptxas that Triton ships (``ptxas -v``), or why not."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return "(no ptxas)"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    return f"regs {regs[0] if regs else '?'} spill {spills[0] if spills else '?'} B"


def compile_variant(fmt: int, odt: int, cvt: int, opq: int,
                    maxnreg: int | None = None) -> triton.compiler.CompiledKernel:
    """The split kernel as the decode launch compiles it for 16 heads (V2-Lite) at batch 64 x 8k tokens on an H100:
    4 splits of 2,048 tokens, the tiles, warps and stages of ``mla_decode._tiles``."""
    fn = mla_decode._mla_decode_split
    _, bn, warps, stages = mla_decode._tiles(16, fmt != 0, 2048, 4)
    const = dict(L=512, R=64, BL=512, BR=64, PAGE=64, BH=16, BN=bn, SPLITS=4, WS=4, HAS_LSE=False,
                 PREC="tf32", G=1, MODE=0, FMT=fmt, ODT=odt, CVT=cvt, OPQ=opq, s_lens=1)
    sig = {n: "constexpr" if n in const else POINTERS.get(n, "i32") for n in fn.arg_names}
    sig["KV"] = "*u8" if fmt else "*bf16"
    # A launch's specialisation: Triton's JIT marks each pointer 16-byte aligned and each int a multiple of 16
    # when it is (every one at V2-Lite's shapes: strides of 512 / 576 / 192 values, 64-token blocks) and makes
    # an int equal to 1 a constant (s_lens); without these hints the loads would compile scalar and unpipelined.
    hinted = [i for i, n in enumerate(fn.arg_names) if sig[n] != "constexpr" and sig[n] != "fp32"]
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in hinted})
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write each variant's TTGIR and PTX here")
    ap.add_argument("--maxnreg", type=int, help="cap the registers a thread (mla_decode.MAXNREG)")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90" + (f", maxnreg {a.maxnreg}" if a.maxnreg else ""))
    for name, fmt, odt, cvt, opq in VARIANTS:
        k = compile_variant(fmt, odt, cvt, opq, maxnreg=a.maxnreg)
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        widths = sorted(set(re.findall(r"kWidth = (\d+)", ttgir)))
        counts = {op: len(re.findall(pat, ptx)) for op, pat in (
            ("ldmatrix", r"\bldmatrix"), ("stmatrix", r"\bstmatrix"), ("ld.shared", r"\bld\.shared"),
            ("st.shared", r"\bst\.shared"), ("shfl", r"\bshfl"), ("mma", r"\bmma\.sync"),
            ("ld.global", r"\bld\.global"), ("cp.async", r"\bcp\.async\.(?:ca|cg)"))}
        print(f"{name:26s} kWidth {','.join(widths):4s} shared {k.metadata.shared:6d} B  "
              + "  ".join(f"{op} {n}" for op, n in counts.items()) + "  " + registers(ptx), flush=True)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            slug = name.replace(" ", "_")
            (a.out / f"{slug}.ttgir").write_text(ttgir)
            (a.out / f"{slug}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
