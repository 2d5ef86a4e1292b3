"""The MTP layer's embedding and shared head, which DeepSeek's checkpoints store as copies of the model's own
tables, are held once (``weights.share_mtp_tables``, called by ``executor.load_model``); tables that differ are
kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.executor import load_model
from pdctl.tiny_model import make_tiny_model

SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 1})


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mtp-tables") / "v3-mtp", arch="v3", seed=3, mtp_layers=1)


def _load(path: Path, **kw: object):
    mc = ModelConfig.from_pretrained(path)
    model = load_model(EngineConfig(model=str(path), speculative_config=SPEC, **kw), mc, torch.float32,
                       torch.device("cpu"))
    return model, model.mtp[str(mc.num_hidden_layers)]


def test_a_checkpoints_copies_are_held_once(mtp_model: Path) -> None:
    files = {name: t for f in mtp_model.glob("*.safetensors") for name, t in load_file(f).items()}
    n = ModelConfig.from_pretrained(mtp_model).num_hidden_layers
    assert torch.equal(files[f"model.layers.{n}.shared_head.head.weight"], files["lm_head.weight"])  # copies
    model, mtp = _load(mtp_model)
    assert mtp.shared_head.head.weight is model.lm_head.weight
    assert mtp.embed_tokens.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, files["lm_head.weight"].float())
    held = {p.data_ptr() for p in model.parameters()}
    assert mtp.shared_head.head.weight.data_ptr() in held and len(held) == len(list(model.parameters()))


def test_dummy_weights_copy_the_tables_as_checkpoints_do(mtp_model: Path) -> None:
    model, mtp = _load(mtp_model, load_format="dummy")
    assert mtp.shared_head.head.weight is model.lm_head.weight
    assert mtp.embed_tokens.weight is model.model.embed_tokens.weight


def test_an_mtp_head_of_its_own_is_kept(mtp_model: Path, tmp_path: Path) -> None:
    own = tmp_path / "own-head"
    own.mkdir()
    for f in mtp_model.iterdir():
        if f.suffix != ".safetensors":
            (own / f.name).write_bytes(f.read_bytes())
    n = ModelConfig.from_pretrained(mtp_model).num_hidden_layers
    for f in mtp_model.glob("*.safetensors"):
        tensors = load_file(f)
        name = f"model.layers.{n}.shared_head.head.weight"
        if name in tensors:
            tensors[name] = tensors[name] * 2
        save_file(tensors, own / f.name, metadata={"format": "pt"})
    model, mtp = _load(own)
    assert mtp.shared_head.head.weight is not model.lm_head.weight
    assert torch.equal(mtp.shared_head.head.weight, 2 * model.lm_head.weight)
    assert mtp.embed_tokens.weight is model.model.embed_tokens.weight  # still a copy: shared
