"""Block FP8 in DeepSeek's format (engine/fp8.py): the quantizer round-trips within e4m3's error, ue8m0
scales are powers of two, shapes that are not multiples of 128 are padded for the scale only; the
loader reads an FP8 checkpoint into exactly its dequantized twin and refuses bad ones, naming the
tensor; a quantization the engine does not run is refused naming its method."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.fp8 import FP8_DTYPE, FP8_MAX, Fp8Config, dequantize_blocks, quantize_blocks, scale_shape

KW = dict(dtype="float32", device="cpu", max_model_len=512)
PROMPTS = [[(i * 7 + k) % 1000 + 2 for i in range(n)] for k, n in ((3, 70), (5, 9), (1, 33))]


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 129), (576, 64)])
def test_dequantize_of_quantize_is_within_e4m3_error(shape: tuple[int, int], ue8m0: bool) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])  # channels of very different sizes
    q, s = quantize_blocks(w, ue8m0=ue8m0)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32
    assert tuple(s.shape) == scale_shape(shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize_blocks(q, s)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of a normal value; below 2^-6 (subnormals) the step
    # is fixed at 2^-9 of the block's scale.
    step = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    assert bool(((back - w).abs() <= w.abs() / 16 + step * 2.0**-10 + 1e-12).all())
    if ue8m0:
        assert bool((torch.log2(s) == torch.round(torch.log2(s))).all())  # powers of two
        assert float(q.float().abs().max()) <= FP8_MAX
    else:  # each block's largest value maps to e4m3's largest
        blocks = q.float().abs()
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                assert float(blocks[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].max()) == FP8_MAX


def test_a_zero_block_gets_a_finite_scale() -> None:
    q, s = quantize_blocks(torch.zeros(130, 10))
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all()) and float(dequantize_blocks(q, s).abs().max()) == 0


def test_quantization_configs() -> None:
    ds = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert Fp8Config.from_dict(ds) == Fp8Config()
    assert Fp8Config.from_dict(ds | {"scale_fmt": "ue8m0"}) == Fp8Config(ue8m0=True)
    assert Fp8Config.from_dict(Fp8Config(ue8m0=True).to_dict()) == Fp8Config(ue8m0=True)
    for bad, words in [({"quant_method": "awq", "bits": 4}, "'awq' is not supported"),
                       ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
                       (ds | {"weight_block_size": [64, 64]}, "[64, 64] is not supported"),
                       (ds | {"weight_block_size": None}, "per-tensor"),
                       (ds | {"activation_scheme": "static"}, "'static'"),
                       (ds | {"fmt": "e5m2"}, "'e5m2'"),
                       (ds | {"scale_fmt": "e8m0x"}, "'e8m0x'")]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            Fp8Config.from_dict(bad)


def test_an_fp8_checkpoint_generates_what_its_dequantized_twin_does(fp8_model: tuple[Path, Path]) -> None:
    fp8, twin = fp8_model
    assert ModelConfig.from_pretrained(fp8).quantization == Fp8Config()
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
    with LLM(str(fp8), **KW) as a, LLM(str(twin), **KW) as b:
        wa = dict(a.engine.model.named_parameters())
        for name, p in b.engine.model.named_parameters():
            assert torch.equal(wa[name], p), name  # the loader dequantizes to the twin's very weights
        got, want = a.generate(PROMPTS, params), b.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


def _broken(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    shutil.copytree(src, dst)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


W = "model.layers.1.self_attn.o_proj.weight"


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.pop(W + "_scale_inv"), f"'{W}' is FP8 but the checkpoint has no '{W}_scale_inv'"),
    (lambda t: t.__setitem__(W + "_scale_inv", torch.ones(3, 3)), r"has shape \(3, 3\)"),
    (lambda t: t.__setitem__(W + "_scale_inv", torch.full_like(t[W + "_scale_inv"], float("nan"))),
     "not finite and positive"),
    (lambda t: t.__setitem__(W + "_scale_inv", -t[W + "_scale_inv"]), "not finite and positive"),
    (lambda t: t.__setitem__(W, t[W].float()), "which is F32, not FP8"),
    (lambda t: t.__setitem__("model.layers.1.self_attn.nope.weight_scale_inv", torch.ones(1, 1)),
     "which the checkpoint does not have"),
])
def test_a_bad_fp8_checkpoint_fails_at_load_naming_the_tensor(fp8_model, tmp_path: Path, edit, words: str) -> None:
    bad = _broken(fp8_model[0], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=words):
        LLM(str(bad), **KW)


def test_fp8_tensors_without_a_quantization_config_are_refused(fp8_model, tmp_path: Path) -> None:
    bad = tmp_path / "noconfig"
    shutil.copytree(fp8_model[0], bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="is FP8 but config.json declares no quantization_config"):
        LLM(str(bad), **KW)


def test_an_unsupported_quantization_is_refused_naming_it(fp8_model, tmp_path: Path) -> None:
    bad = tmp_path / "awq"
    shutil.copytree(fp8_model[1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization method 'awq' is not supported by the native engine"):
        LLM(str(bad), **KW)


def test_make_model_quantize_writes_deepseeks_format(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pdctl.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["make-model", str(tmp_path / "m"), "--quantize", "fp8", "--scale-fmt", "ue8m0"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                          "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        fp8 = {n for n in names if f.get_tensor(n).dtype == FP8_DTYPE}
        scales = [f.get_tensor(n) for n in names if n.endswith("_scale_inv")]
        router = f.get_tensor("model.layers.1.mlp.gate.weight")
    # every attention projection, dense MLP, routed and shared expert; not the router, norms, embeddings, head
    assert {n + "_scale_inv" for n in fp8} == {n for n in names if n.endswith("_scale_inv")}
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in fp8 and "model.layers.0.mlp.gate_proj.weight" in fp8
    assert "model.layers.1.self_attn.kv_b_proj.weight" in fp8 and router.dtype == torch.float32
    assert not fp8 & {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert all(bool((torch.log2(s) == torch.round(torch.log2(s))).all()) for s in scales)
    r = runner.invoke(app, ["make-model", str(tmp_path / "x"), "--scale-fmt", "ue8m0"])
    assert r.exit_code != 0 and "--quantize fp8" in r.output


def test_dummy_weights_of_an_fp8_config_are_on_the_fp8_grid(fp8_model) -> None:
    """``load_format: dummy`` with an FP8 config: every weight DeepSeek quantizes holds values its block
    quantizer gives back unchanged (what a real FP8 checkpoint loads to); the rest stay as they were."""
    import torch

    from engine.config import ModelConfig
    from engine.fp8 import dequantize_blocks, quantize_blocks
    from engine.weights import build_empty_model, init_random_weights

    mc = ModelConfig.from_pretrained(fp8_model[0])
    assert mc.quantization is not None
    model = build_empty_model(mc, torch.float32, torch.device("cpu"))
    init_random_weights(model, seed=0)
    params = dict(model.named_parameters())

    def on_grid(w: torch.Tensor) -> bool:
        return torch.equal(dequantize_blocks(*quantize_blocks(w)), w)

    assert on_grid(params["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
    moe = next(n for n in params if n.endswith(".mlp.w13"))
    assert all(on_grid(half) for e in params[moe] for half in e.chunk(2))
    assert not on_grid(params["lm_head.weight"])  # the LM head stays as stored (bf16 in DeepSeek's)


def test_the_weights_a_node_says_it_holds() -> None:
    from engine.fp8_compute import weights_held

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    assert weights_held(False, torch.bfloat16, cuda) == "bfloat16"
    assert weights_held(True, torch.bfloat16, cuda) == "fp8 experts, bfloat16"  # (a GPU without FP8 fails at load)
    assert weights_held(True, torch.float32, cpu) == "float32, from fp8"
