"""Tests for pdctl.tiny_model: determinism, config, tensor names, transformers/tokenizer loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from pdctl.tiny_model import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, USER_TOKEN, make_tiny_model

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
VARIANTS = {"v2": ("v2", True), "v3": ("v3", True), "v2_dense": ("v2", False)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_model(root / name, arch=a, moe=m) for name, (a, m) in VARIANTS.items()}


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        return {k: f.get_tensor(k) for k in f.keys()}


def test_same_seed_is_byte_identical(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", arch="v2", moe=True, seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (model_dirs["v2"] / name).read_bytes(), name


def test_different_seed_changes_weights_only(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "other", arch="v2", moe=True, seed=1)
    assert (other / "model.safetensors").read_bytes() != (model_dirs["v2"] / "model.safetensors").read_bytes()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (other / name).read_bytes() == (model_dirs["v2"] / name).read_bytes(), name


def test_config_v2(model_dirs: dict[str, Path]) -> None:
    cfg = _config(model_dirs["v2"])
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64 and cfg["q_lora_rank"] is None
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]) == (256, 4, 3)
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_shared_experts"]) == (8, 2, 2)
    assert cfg["topk_method"] == "greedy" and cfg["scoring_func"] == "softmax"
    assert cfg["rope_scaling"]["type"] == cfg["rope_scaling"]["rope_type"] == "yarn"
    assert cfg["rope_scaling"]["factor"] == 4.0 and "rope_parameters" not in cfg
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)


def test_config_v3_and_dense(model_dirs: dict[str, Path]) -> None:
    v3 = _config(model_dirs["v3"])
    assert v3["architectures"] == ["DeepseekV3ForCausalLM"] and v3["model_type"] == "deepseek_v3"
    assert v3["q_lora_rank"] == 128 and v3["rope_interleave"] is True
    assert (v3["n_routed_experts"], v3["num_experts_per_tok"], v3["n_group"], v3["topk_group"]) == (16, 4, 4, 2)
    assert v3["topk_method"] == "noaux_tc" and v3["scoring_func"] == "sigmoid"
    assert v3["routed_scaling_factor"] == 2.5 and v3["norm_topk_prob"] is True
    dense = _config(model_dirs["v2_dense"])
    assert dense.get("n_routed_experts") is None and dense["first_k_dense_replace"] == 3


def test_tensor_names_and_shapes(model_dirs: dict[str, Path]) -> None:
    v2 = _tensors(model_dirs["v2"])
    assert all(t.dtype == torch.float32 for t in v2.values())
    assert v2["model.layers.0.mlp.gate_proj.weight"].shape == (512, 256)
    assert v2["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 96, 256)
    assert v2["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 256)
    assert v2["model.layers.1.self_attn.kv_b_proj.weight"].shape == (4 * 64, 512)
    assert v2["model.layers.2.mlp.gate.weight"].shape == (8, 256)
    assert v2["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (256, 64)
    assert v2["model.layers.2.mlp.shared_experts.up_proj.weight"].shape == (128, 256)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in v2
    assert not any("gate_up_proj" in k for k in v2)
    v3 = _tensors(model_dirs["v3"])
    assert v3["model.layers.1.self_attn.q_a_proj.weight"].shape == (128, 256)
    assert v3["model.layers.1.self_attn.q_a_layernorm.weight"].shape == (128,)
    assert v3["model.layers.1.self_attn.q_b_proj.weight"].shape == (4 * 96, 128)
    assert v3["model.layers.1.mlp.gate.e_score_correction_bias"].shape == (16,)
    assert "model.layers.1.self_attn.q_proj.weight" not in v3
    dense = _tensors(model_dirs["v2_dense"])
    assert not any(".experts." in k or ".gate.weight" in k for k in dense)
    assert all(f"model.layers.{i}.mlp.down_proj.weight" in dense for i in range(3))


def test_overrides_reshape_weights(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "o", num_layers=2, overrides={"hidden_size": 128})
    assert _config(d)["hidden_size"] == 128 and _config(d)["num_hidden_layers"] == 2
    w = _tensors(d)
    assert w["model.embed_tokens.weight"].shape[1] == 128 and "model.layers.2.input_layernorm.weight" not in w


def test_bad_arch_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "bad", arch="v4")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_loads_all_keys(model_dirs: dict[str, Path], variant: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    d = model_dirs[variant]
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.rope_parameters["rope_type"] == "yarn"
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(4, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits[0]
    std = logits.std(-1)
    assert torch.all((std > 3.0) & (std < 5.0)), std
    top2 = logits.topk(2, -1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.3


def test_tokenizer_bos_roundtrip_and_chat_template(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    d = model_dirs["v2"]
    tok = AutoTokenizer.from_pretrained(d)
    ids = [tok.convert_tokens_to_ids(t) for t in (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)]
    assert ids == [0, 1, 2, 3] and tok.bos_token_id == 0 and tok.eos_token_id == tok.pad_token_id == 1
    assert len(tok) == _config(d)["vocab_size"]
    assert 1000 <= len(tok) <= 2000
    assert tok("hi").input_ids[0] == tok.bos_token_id
    text = "Serving a tiny model on the cluster, 42 times!"
    enc = tok(text).input_ids
    assert enc.count(0) == 1 and tok.decode(enc, skip_special_tokens=True) == text
    assert tok(text, add_special_tokens=False).input_ids == enc[1:]
    # The raw tokenizers file (what a non-transformers engine loads) prepends BOS too.
    assert Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids == enc

    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    expected = f"{BOS_TOKEN}Be brief.{USER_TOKEN}Hi{ASSISTANT_TOKEN}Hello{EOS_TOKEN}{USER_TOKEN}Bye{ASSISTANT_TOKEN}"
    assert prompt == expected
    assert tok.apply_chat_template(msgs[:2], tokenize=False) == f"{BOS_TOKEN}Be brief.{USER_TOKEN}Hi"
    chat_ids = tok(prompt, add_special_tokens=False).input_ids
    assert chat_ids[0] == 0 and chat_ids[-1] == 3 and chat_ids.count(0) == 1


def test_config_only_preset_has_a_tokenizer_for_its_whole_vocabulary(tmp_path) -> None:
    import subprocess
    import sys

    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer as EngineTokenizer

    r = subprocess.run([sys.executable, "-m", "pdctl.cli", "make-model", str(tmp_path / "v2l"), "--preset", "v2-lite",
                        "--config-only"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not list((tmp_path / "v2l").glob("*.safetensors"))
    cfg = ModelConfig.from_pretrained(tmp_path / "v2l")
    assert cfg.vocab_size == 102400 and cfg.num_hidden_layers == 27
    tok = EngineTokenizer(tmp_path / "v2l")
    assert tok.decode([5000, 102399]) == " t5000 t102399"  # every id the model can sample has text
    tiny = EngineTokenizer(make_tiny_model(tmp_path / "tiny"))
    assert tok.encode("Hello there, cluster!") == tiny.encode("Hello there, cluster!")  # text encodes as before
    r = subprocess.run([sys.executable, "-m", "pdctl.cli", "make-model", str(tmp_path / "x"), "--config-only"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--preset" in r.stdout + r.stderr


def test_config_only_v3_preset_in_block_fp8(tmp_path) -> None:
    """``--preset v3 --config-only --quantize fp8``: DeepSeek-V3's shape with its FP8 quantization_config,
    which the engine reads as block FP8 (dummy weights are then made in FP8)."""
    import subprocess
    import sys

    from engine.config import ModelConfig

    r = subprocess.run([sys.executable, "-m", "pdctl.cli", "make-model", str(tmp_path / "v3"), "--preset", "v3",
                        "--config-only", "--quantize", "fp8", "--scale-fmt", "ue8m0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cfg = ModelConfig.from_pretrained(tmp_path / "v3")
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers) == (7168, 256, 8, 61)
    assert cfg.topk_method == "noaux_tc" and cfg.q_lora_rank == 1536
    assert cfg.quantization is not None and cfg.quantization.ue8m0 and cfg.quantization.block == (128, 128)
