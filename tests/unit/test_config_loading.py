"""Config spellings and weight-file layouts that real checkpoints use."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from engine import LLM
from engine.config import ModelConfig
from pdctl.cli import app

PROMPT = [[5, 17, 99, 250, 3, 800, 41, 12]]


def _logits(path) -> torch.Tensor:
    with LLM(str(path), dtype="float32", max_model_len=64) as llm:
        return llm.prompt_logits(PROMPT)[0]


def test_rope_parameters_spelling_equals_rope_scaling(tiny_model, tmp_path) -> None:
    """transformers 5 writes rope_parameters (rope_theta inside); the Hub has rope_scaling + rope_theta."""
    d = shutil.copytree(tiny_model, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    rope = dict(cfg.pop("rope_scaling"))
    rope["rope_theta"] = cfg.pop("rope_theta")
    rope["rope_type"] = rope.pop("type")
    cfg["rope_parameters"] = rope
    (d / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_pretrained(d) == ModelConfig.from_pretrained(tiny_model)
    assert ModelConfig.from_pretrained(d).rope.rope_type == "yarn"


def test_sharded_index_and_fused_experts_load_the_same(tiny_model, tmp_path) -> None:
    ref = _logits(tiny_model)
    weights = load_file(tiny_model / "model.safetensors")
    d = tmp_path / "sharded"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / f, d / f)
    # transformers-5 layout for layer 2: fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    n_exp = sum(1 for k in weights if k.startswith("model.layers.2.mlp.experts.") and k.endswith("down_proj.weight"))
    pre = "model.layers.2.mlp.experts"
    weights[f"{pre}.gate_up_proj"] = torch.stack(
        [torch.cat([weights.pop(f"{pre}.{e}.gate_proj.weight"), weights.pop(f"{pre}.{e}.up_proj.weight")])
         for e in range(n_exp)])
    weights[f"{pre}.down_proj"] = torch.stack([weights.pop(f"{pre}.{e}.down_proj.weight") for e in range(n_exp)])
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: weights[k].contiguous() for k in keys}, d / fname, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(_logits(d), ref)


def test_pdctl_make_model_is_deterministic(tmp_path) -> None:
    runner = CliRunner()
    for name in ("a", "b"):
        res = runner.invoke(app, ["make-model", str(tmp_path / name), "--dense", "--seed", "4"])
        assert res.exit_code == 0, res.output
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    cfg = ModelConfig.from_pretrained(tmp_path / "a")
    assert cfg.n_routed_experts is None and cfg.kv_lora_rank == 512 and cfg.qk_rope_head_dim == 64
    assert cfg.rope.rope_type == "yarn"
    bad = runner.invoke(app, ["make-model", str(tmp_path / "c"), "--arch", "v9"])
    assert bad.exit_code != 0 and "arch must be v2 or v3" in bad.output


def test_an_engine_on_several_gpus_takes_them_from_its_device() -> None:
    """``--device cuda:K``: rank processes (and a decode node's DP replicas) run on GPUs K, K+1, ..."""
    from engine.engine_config import EngineConfig
    from engine.parallel.rank_worker import rank_device

    assert EngineConfig(model="m", device="cuda:1").first_gpu() == 1
    assert EngineConfig(model="m", device="cuda").first_gpu() == 0
    assert EngineConfig(model="m", device="cpu").first_gpu() == 0
    cfg = EngineConfig(model="m", device="cuda:2", pcp=2)
    assert [rank_device(cfg, r) for r in range(2)] == [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert rank_device(EngineConfig(model="m", device="cpu", pcp=2), 1) == torch.device("cpu")


def test_an_engine_takes_the_gpus_it_lists() -> None:
    """``--gpus 5,2``: rank r (or DP replica r) runs on the r-th GPU listed, whatever the device."""
    from engine.engine_config import EngineConfig
    from engine.parallel.rank_worker import rank_device

    cfg = EngineConfig(model="m", gpus="5,2", pcp=2)
    assert cfg.gpu_ids(2) == [5, 2] and cfg.first_gpu() == 5 and cfg.torch_device() == torch.device("cuda", 5)
    assert [rank_device(cfg, r) for r in range(2)] == [torch.device("cuda", 5), torch.device("cuda", 2)]
    assert EngineConfig(model="m", device="cuda:3").gpu_ids(2) == [3, 4]
    with pytest.raises(ValueError, match="lists 1 GPUs; this engine needs 2"):
        EngineConfig(model="m", gpus="1").gpu_ids(2)
    for bad in ("a,b", "1,1", "-1", ""):
        with pytest.raises(ValueError, match="gpus must"):
            EngineConfig(model="m", gpus=bad)
    with pytest.raises(ValueError, match="device is cpu"):
        EngineConfig(model="m", gpus="0", device="cpu")
