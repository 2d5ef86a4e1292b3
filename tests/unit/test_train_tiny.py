"""``pdctl make-model --train``: the tiny model and its MTP layer learn the corpus, and the engine loads what
was written (the checkpoint layout, the MTP layer's copies of the embedding and the head)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from pdctl.train_tiny import corpus_ids


def test_training_lowers_both_losses_and_the_engine_serves_the_result(trained_mtp) -> None:
    # tests/unit/conftest.py: the model, its weights before training, one step's report, then 60 steps'
    model, before, first, report = trained_mtp.model, trained_mtp.before, trained_mtp.first, trained_mtp.report
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
