"""DeepSeek-V3's multi-token prediction layer (``engine.model.MTPLayer``) against a plain PyTorch reference.

transformers ignores the MTP weights (``model.layers.{N}``), so the reference is written here: its decoder
block is transformers' own ``DeepseekV3DecoderLayer`` (loaded as layer N of a model one layer deeper, so the
checkpoint's per-expert tensors go through transformers' own conversion), and the rest (embedding,
``enorm``, ``hnorm``, ``eh_proj``, the shared head) is written out with torch ops, from the checkpoint's
tensors read directly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch, PrefillSegment, slots_for
from engine.kv_cache import KVCache
from engine.kv_format import KVFormat
from engine.weights import build_empty_model, load_weights
from pdctl.tiny_model import make_tiny_model

BLOCK = 16


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mtp") / "v3-mtp", arch="v3", moe=True, seed=5, mtp_layers=1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp_logits(path: Path, prompt: list[int], next_ids: list[int]) -> torch.Tensor:
    """Logits [n, V] of the MTP layer at each prompt position, written out (module docstring)."""
    cfg = AutoConfig.from_pretrained(str(path))
    n_layers = cfg.num_hidden_layers
    w = {k.removeprefix(f"model.layers.{n_layers}."): v for k, v in load_file(str(path / "model.safetensors")).items()
         if k.startswith(f"model.layers.{n_layers}.")}
    eps = cfg.rms_norm_eps
    ids = torch.tensor([prompt])
    with torch.no_grad():
        target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        hidden = target.model(ids).last_hidden_state  # [1, n, D], after the final norm
        deeper = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, num_hidden_layers=n_layers + 1,
                                                      attn_implementation="eager").eval()
        block = deeper.model.layers[n_layers]  # the MTP layer's decoder block, as transformers runs one
        embedded = torch.nn.functional.embedding(torch.tensor([next_ids]), w["embed_tokens.weight"])
        x = torch.cat([_rms(embedded, w["enorm.weight"], eps), _rms(hidden, w["hnorm.weight"], eps)], dim=-1)
        x = x @ w["eh_proj.weight"].T
        n = len(prompt)
        positions = torch.arange(n).unsqueeze(0)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        h = block(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=deeper.model.rotary_emb(x, positions))
        return (_rms(h, w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T)[0]


def engine_mtp_logits(path: Path, prompt: list[int], next_ids: list[int]) -> torch.Tensor:
    """The same through our model: the prompt as one prefill step, then the MTP layer on its rows."""
    mc = ModelConfig.from_pretrained(path)
    model = build_empty_model(mc, torch.float32, torch.device("cpu"), mtp=True)
    load_weights(model, path)
    n, mtp_idx = len(prompt), mc.num_hidden_layers
    fmt = KVFormat("auto", mc.kv_lora_rank, mc.qk_rope_head_dim, torch.float32)
    cache = KVCache(fmt, range(mtp_idx + 1), -(-n // BLOCK), BLOCK, torch.device("cpu"))
    table = torch.arange(-(-n // BLOCK))
    batch = ForwardBatch(
        input_ids=torch.tensor(prompt), positions=torch.arange(n), slot_mapping=slots_for(table, 0, n, BLOCK),
        num_decode=0, decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
        decode_seq_lens=torch.zeros(0, dtype=torch.long), decode_max_len=0,
        prefills=[PrefillSegment(0, n, 0, table)], logits_rows=torch.arange(n))
    with torch.inference_mode():
        hidden = model(batch, cache.layers)
        assert model.mtp is not None
        layer = model.mtp[str(mtp_idx)]
        h = layer.predict(torch.tensor(next_ids), hidden, batch, cache.layers[mtp_idx], model.rope)
        return layer.compute_logits(h)


@pytest.mark.parametrize("n", [5, 40])
def test_the_mtp_layers_logits_equal_the_plain_reference(mtp_model: Path, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(4, 1000, (n + 1,), generator=g).tolist()
    prompt, next_ids = tokens[:n], tokens[1:]  # row i: the target's hidden at i and the token at i + 1
    ref = reference_mtp_logits(mtp_model, prompt, next_ids)
    got = engine_mtp_logits(mtp_model, prompt, next_ids)
    assert got.shape == ref.shape == (n, ModelConfig.from_pretrained(mtp_model).vocab_size)
    assert (got - ref).abs().max().item() < 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_the_mtp_weights_load_only_when_asked_and_the_rest_equals_a_model_without_them(
        mtp_model: Path, tmp_path: Path) -> None:
    mc = ModelConfig.from_pretrained(mtp_model)
    assert mc.num_nextn_predict_layers == 1
    plain = build_empty_model(mc, torch.float32, torch.device("cpu"))
    load_weights(plain, mtp_model)  # the MTP layer's tensors are skipped
    assert plain.mtp is None
    without = make_tiny_model(tmp_path / "v3", arch="v3", moe=True, seed=5)  # the same draws, no MTP layer
    assert load_file(str(without / "model.safetensors")).keys() < load_file(str(mtp_model / "model.safetensors")).keys()
    other = build_empty_model(ModelConfig.from_pretrained(without), torch.float32, torch.device("cpu"))
    load_weights(other, without)
    for (name, a), (_, b) in zip(plain.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="no multi-token prediction layer"):
        build_empty_model(ModelConfig.from_pretrained(without), torch.float32, torch.device("cpu"), mtp=True)
