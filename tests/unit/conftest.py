"""The tiny model trained once for the modules that need one that learned its corpus (training is the slow part)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdctl.tiny_model import make_tiny_model
from pdctl.train_tiny import TrainReport, train_tiny_model


@dataclass(frozen=True)
class Trained:
    model: Path  # a V3 dense model with one MTP layer, trained on the corpus
    before: dict[str, torch.Tensor]  # its checkpoint's tensors before training
    first: TrainReport  # one step's: the untrained model's losses
    report: TrainReport  # the 60 further steps'


@pytest.fixture(scope="session")
def trained_mtp(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """``pdctl make-model --train``'s model: the losses fall and its MTP layer learns enough for some drafts to
    hold, not all (test_train_tiny.py checks the training, test_speculative.py samples from the result)."""
    model = make_tiny_model(tmp_path_factory.mktemp("trained") / "tiny", arch="v3", moe=False, seed=4, mtp_layers=1)
    before = load_file(str(model / "model.safetensors"))
    first = train_tiny_model(model, steps=1, seed=4)
    return Trained(model, before, first, train_tiny_model(model, steps=60, seed=4))
