"""Bad input fails with errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tiny_model, tmp_path) -> None:
    d = _copy(tiny_model, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown architecture.*LlamaForCausalLM"):
        LLM(str(d), dtype="float32")


def test_missing_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_weight(tiny_model, tmp_path) -> None:
    d = _copy(tiny_model, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    del w["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(w, d / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 weights.*layers.1.self_attn.kv_b_proj"):
        LLM(str(d), dtype="float32")


def test_missing_expert_weight(tiny_model, tmp_path) -> None:
    d = _copy(tiny_model, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    del w["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(w, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj"):
        LLM(str(d), dtype="float32")


def test_misshaped_weight(tiny_model, tmp_path) -> None:
    d = _copy(tiny_model, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    w["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(7, 7)
    save_file(w, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"o_proj.weight.*shape \(7, 7\)"):
        LLM(str(d), dtype="float32")


def test_no_weights(tiny_model, tmp_path) -> None:
    d = _copy(tiny_model, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        LLM(str(d), dtype="float32")


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), dtype="float32", max_model_len=64) as llm:
        yield llm


def test_prompt_longer_than_max_model_len(llm) -> None:
    with pytest.raises(ValueError, match="65 tokens, more than max_model_len 64"):
        llm.generate([[5] * 65], SamplingParams(max_tokens=1))
    assert llm.engine.num_used_blocks == 0 and not llm.engine.has_unfinished()


def test_empty_and_out_of_vocab_prompts(llm) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 100000]], SamplingParams())


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm) -> None:
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [5] * 100], SamplingParams(max_tokens=3))
    assert llm.engine.num_used_blocks == 0 and not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": -1}, "max_tokens must be >= 0"),
        ({"logprobs": 99}, "logprobs must be in"),
        ({"n": 2}, "n must be 1"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop strings"),
    ],
)
def test_invalid_sampling_params(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float8"}, "dtype must be"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be > 0"),
        ({"max_model_len": 10**6}, "exceeds the model's max_position_embeddings"),
        ({"num_kv_blocks": 1, "max_model_len": 64}, "cannot hold one request"),
    ],
)
def test_invalid_engine_settings(tiny_model, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model), **kwargs)
