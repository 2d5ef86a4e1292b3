"""``pdctl make-model --train``: the tiny model and its MTP layer learn the corpus, and the engine loads what
was written (the checkpoint layout, the MTP layer's copies of the embedding and the head)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from pdctl.tiny_model import make_tiny_model
from pdctl.train_tiny import corpus_ids, train_tiny_model


def test_training_lowers_both_losses_and_the_engine_serves_the_result(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny", arch="v3", moe=False, seed=2, mtp_layers=1)
    before = load_file(str(model / "model.safetensors"))
    first = train_tiny_model(model, steps=1, seed=2)
    report = train_tiny_model(model, steps=40, seed=2)
    assert report.loss < first.loss - 2 and report.mtp_loss is not None and report.mtp_loss < first.mtp_loss - 2
    after = load_file(str(model / "model.safetensors"))
    assert after.keys() == before.keys()  # the same tensors, in the checkpoint's names
    assert torch.equal(after["model.layers.3.shared_head.head.weight"], after["lm_head.weight"])
    assert torch.equal(after["model.layers.3.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert not torch.equal(after["model.layers.3.eh_proj.weight"], before["model.layers.3.eh_proj.weight"])
    prompt = corpus_ids(model)[0][:12]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", max_model_len=256)
    with LLM(str(model), **kw) as llm:
        plain = llm.generate([prompt], sp)[0].token_ids
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    with LLM(str(model), speculative_config=spec, **kw) as llm:
        assert llm.generate([prompt], sp)[0].token_ids == plain
        assert llm.engine.spec_counts.accepted_tokens > 0  # it learned enough for some drafts to hold
