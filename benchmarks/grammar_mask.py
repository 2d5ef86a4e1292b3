"""Per-token cost of grammar-constrained decoding: xgrammar against llguidance, same schemas, same tokens.

  python3 benchmarks/grammar_mask.py                       # V2-Lite's tokenizer (102,400 ids), CPU
  python3 benchmarks/grammar_mask.py --model DIR --steps 200

For each library and each schema of a small corpus (a medium JSON schema, JSON of any shape, a regex,
a choice): the tokenizer set-up time, the compile time, then a decode of random logits where each step
fills the next-token mask for the matcher state, applies it to the logits, takes the argmax and
advances the matcher. Reported per token: the mask fill (the host work a decode step adds) and the
mask's application to a [1, V] logits row, p50 and p99 in microseconds, and whether each finished
output parses as JSON and validates against its schema. Both libraries see the same logits. The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from presets import MEDIUM_SCHEMA  # noqa: E402

from engine.structured_output import allocate_bitmask, apply_bitmask  # noqa: E402

CORPUS: list[tuple[str, str, Any]] = [
    ("medium_schema", "json", MEDIUM_SCHEMA),
    ("json_object", "json", {"type": "object"}),
    ("regex", "regex", r"\d{3}-\d{3}-\d{4}"),
    ("choice", "regex", "(positive|negative|neutral)"),
]


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tok: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, vocab: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, vocab)

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(mask, 0)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, mask)

    def accept(self, m: Any, tok: int) -> bool:
        return bool(m.accept_token(tok))

    def done(self, m: Any) -> bool:
        return bool(m.is_terminated())


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json":
            return self.llg.LLMatcher.grammar_from_json_schema(json.dumps(spec),
                                                               defaults={"whitespace_flexible": False})
        return self.llg.LLMatcher.grammar_from_regex(spec)

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.tok, compiled)
        assert not m.is_error(), m.get_error()
        return m

    def bitmask(self, vocab: int) -> torch.Tensor:
        return allocate_bitmask(1, vocab)

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        self.llg.numpy.fill_next_token_bitmask(m, mask.numpy(), 0)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        apply_bitmask(logits, mask)  # the engine's (llguidance.torch's own is a torch.compile function)

    def accept(self, m: Any, tok: int) -> bool:
        return bool(m.consume_token(tok))

    def done(self, m: Any) -> bool:
        return bool(m.is_stopped())


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _valid(kind: str, spec: Any, text: str) -> bool:
    import re

    import jsonschema

    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    try:
        jsonschema.validate(json.loads(text), spec)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(lib: Any, decode: Callable[[list[int]], str], eos: int, vocab: int, steps: int, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, kind, spec in CORPUS:
        t0 = time.perf_counter()
        compiled = lib.compile(kind, spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        fills: list[float] = []
        applies: list[float] = []
        ok = finished = 0
        for r in range(runs):
            gen = torch.Generator().manual_seed(r)
            m = lib.matcher(compiled)
            mask = lib.bitmask(vocab)
            toks: list[int] = []
            for _ in range(steps):
                logits = torch.randn(1, vocab, generator=gen)
                t0 = time.perf_counter()
                lib.fill(m, mask)
                t1 = time.perf_counter()
                lib.apply(logits, mask)
                t2 = time.perf_counter()
                fills.append((t1 - t0) * 1e6)
                applies.append((t2 - t1) * 1e6)
                tok = int(logits.argmax())
                assert lib.accept(m, tok), f"{lib.name} refused its own allowed token {tok}"
                if tok == eos:
                    break
                toks.append(tok)
                if lib.done(m):
                    break
            if lib.done(m):
                finished += 1
                ok += _valid(kind, spec, decode(toks))
        out[label] = {"compile_ms": round(compile_ms, 2), "tokens": len(fills),
                      "fill_us_p50": round(statistics.median(fills), 1), "fill_us_p99": round(_pct(fills, 0.99), 1),
                      "apply_us_p50": round(statistics.median(applies), 1), "finished": finished, "valid": ok,
                      "runs": runs}
        print(f"{lib.name:10s} {label:14s} compile {compile_ms:8.2f} ms  fill p50 {out[label]['fill_us_p50']:7.1f} "
              f"p99 {out[label]['fill_us_p99']:7.1f} us  apply p50 {out[label]['apply_us_p50']:6.1f} us  "
              f"finished {finished}/{runs} valid {ok}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a model directory with a tokenizer (default: V2-Lite's, config only)")
    ap.add_argument("--steps", type=int, default=300, help="most tokens per output")
    ap.add_argument("--runs", type=int, default=5, help="outputs per schema (different random logits)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = args.model
    if model is None:
        from pdctl.model_presets import PRESETS
        from pdctl.tiny_model import write_config_only

        model = str(write_config_only(tempfile.mkdtemp(prefix="grammar-mask-"), PRESETS["v2-lite"]))
    hf_tok = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    res: dict[str, Any] = {"benchmark": "grammar_mask", "vocab": vocab, "torch_threads": torch.get_num_threads()}
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        lib = cls(hf_tok, vocab)
        setup_ms = (time.perf_counter() - t0) * 1e3
        print(f"{cls.name}: tokenizer set-up {setup_ms:.0f} ms", flush=True)
        res[cls.name] = {"setup_ms": round(setup_ms, 1),
                         **run(lib, lambda ids: hf_tok.decode(ids), hf_tok.eos_token_id, vocab, args.steps, args.runs)}
    x, g = res["xgrammar"]["medium_schema"], res["llguidance"]["medium_schema"]
    res["medium_fill_p50_llguidance_over_xgrammar"] = round(g["fill_us_p50"] / x["fill_us_p50"], 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
