"""Train a tiny model on the tiny corpus, its multi-token prediction (MTP) layers with it: ``pdctl make-model
--train``.

Random weights accept no draft, so measuring speculative decoding needs a model that has learned something.
This trains the tiny model written by ``pdctl/tiny_model.py`` on ``pdctl/tiny_corpus.py`` (on CPU, a few
minutes) with transformers' own DeepSeek modules as the trainable model: the stack's next-token loss, and
for the first MTP layer DeepSeek-V3's MTP loss beside it (the token after next, from the stack's hidden
state and the next token's embedding; weight ``MTP_WEIGHT``). The MTP layer shares the embedding and the
LM head with the stack while it trains, as DeepSeek's does; the checkpoint stores copies of both under the
layer, as DeepSeek-V3's does. The last paragraph of the corpus is held out (``HELD_OUT``): benchmarks
measure on text the model never saw too.

The weights are written back in the checkpoint layout over the random ones (same config and tokenizer).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pdctl.tiny_corpus import CORPUS

HELD_OUT = 1  # the corpus's last paragraphs, left out of training
MTP_WEIGHT = 0.3  # DeepSeek-V3's lambda for the MTP loss early in training
WINDOW = 96  # tokens per training sequence


@dataclass(frozen=True)
class TrainReport:
    steps: int
    seconds: float
    loss: float  # the stack's next-token loss at the end (mean of the last steps)
    mtp_loss: float | None  # the first MTP layer's (None: the model has none)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class _Trainable(nn.Module):
    """transformers' DeepSeek model one layer deeper than the stack: its last layer is the MTP layer's decoder
    block, fed as DeepSeek-V3's MTP is (module docstring)."""

    def __init__(self, model_dir: Path, layers: int, mtp: bool) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        extra: dict[str, int] = {"num_hidden_layers": layers + 1} if mtp else {}
        if mtp and dense_layers_only(model_dir):  # transformers makes every layer from first_k_dense_replace on
            # a MoE one, n_routed_experts or not: the MTP layer of a dense model is dense
            extra["first_k_dense_replace"] = layers + 1
        self.hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                       attn_implementation="eager", **extra)
        self.layers, self.eps = layers, self.hf.config.rms_norm_eps
        self.mtp: nn.ParameterDict | None = None
        if mtp:
            saved = load_file(str(model_dir / "model.safetensors"))
            prefix = f"model.layers.{layers}."
            self.mtp = nn.ParameterDict({
                name.replace(".", "_"): nn.Parameter(saved[prefix + name].clone())
                for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")})

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, T] -> (the stack's next-token loss, the MTP layer's loss of the token after next)."""
        m = self.hf.model
        t = ids.shape[1]
        pos = torch.arange(t).unsqueeze(0)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = m.embed_tokens(ids)
        rope = m.rotary_emb(x, pos)
        for layer in m.layers[: self.layers]:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        h = m.norm(x)
        ce = nn.functional.cross_entropy
        vocab = self.hf.config.vocab_size
        loss = ce(self.hf.lm_head(h[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1))
        if self.mtp is None:
            return loss, None
        p = self.mtp
        # Row i: the stack's hidden state at i and the token at i + 1 predict the token at i + 2.
        e = _rms(m.embed_tokens(ids[:, 1:]), p["enorm_weight"], self.eps)
        x = torch.cat([e, _rms(h[:, :-1], p["hnorm_weight"], self.eps)], dim=-1) @ p["eh_proj_weight"].T
        x = m.layers[self.layers](x, attention_mask=mask[..., :-1, :-1], position_ids=pos[:, :-1],
                                  position_embeddings=m.rotary_emb(x, pos[:, :-1]))
        logits = self.hf.lm_head(_rms(x[:, :-1], p["shared_head_norm_weight"], self.eps))
        return loss, ce(logits.reshape(-1, vocab), ids[:, 2:].reshape(-1))

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The weights in the checkpoint's layout (the MTP layer's under ``model.layers.{N}``)."""
        out = {k: v.detach().clone().contiguous() for k, v in self.hf.state_dict().items()}
        if self.mtp is not None:
            prefix = f"model.layers.{self.layers}."
            for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
                out[prefix + name] = self.mtp[name.replace(".", "_")].detach().clone()
            out[prefix + "shared_head.head.weight"] = out["lm_head.weight"].clone()
            out[prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        return out


def dense_layers_only(model_dir: Path) -> bool:
    import json

    return json.loads((model_dir / "config.json").read_text()).get("n_routed_experts") is None


def corpus_ids(tokenizer_dir: Path, held_out: bool = False) -> list[list[int]]:
    """The corpus's paragraphs as token ids (with the tokenizer's BOS): those trained on, or the held-out."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(str(tokenizer_dir))
    paragraphs = CORPUS[-HELD_OUT:] if held_out else CORPUS[:-HELD_OUT]
    return [tok.encode(" ".join(p.split())) for p in paragraphs]


def train_tiny_model(model_dir: Path, steps: int = 300, seed: int = 0, batch: int = 8, lr: float = 3e-3,
                     log: bool = False) -> TrainReport:
    """Train the model in ``model_dir`` (written by ``make_tiny_model``) on the corpus and write its weights
    back there. ``log``: print the losses every 50 steps."""
    import json

    torch.manual_seed(seed)
    cfg = json.loads((model_dir / "config.json").read_text())
    layers, mtp = cfg["num_hidden_layers"], bool(cfg.get("num_nextn_predict_layers"))
    net = _Trainable(model_dir, layers, mtp).train()
    stream = torch.tensor([t for p in corpus_ids(model_dir) for t in p])
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    t0 = time.perf_counter()
    recent: list[tuple[float, float]] = []
    for step in range(steps):
        starts = torch.randint(0, len(stream) - WINDOW, (batch,), generator=g)
        ids = torch.stack([stream[s : s + WINDOW] for s in starts.tolist()])
        loss, mtp_loss = net(ids)
        total = loss + MTP_WEIGHT * mtp_loss if mtp_loss is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        recent = (recent + [(loss.item(), mtp_loss.item() if mtp_loss is not None else math.nan)])[-20:]
        if log and (step % 50 == 0 or step == steps - 1):
            print(f"step {step}: loss {recent[-1][0]:.3f}, mtp loss {recent[-1][1]:.3f}", flush=True)
    save_file(net.checkpoint(), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    mean = [sum(r[i] for r in recent) / len(recent) for i in (0, 1)]
    return TrainReport(steps, time.perf_counter() - t0, mean[0], mean[1] if mtp else None)
