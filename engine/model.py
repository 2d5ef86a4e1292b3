"""DeepSeek-V2/V3 decoder stack over a paged latent KV cache.

Parameter names equal the Hugging Face checkpoint keys (``model.layers.{i}.self_attn.kv_b_proj.weight``
…) except the stacked routed experts (see ``engine.layers.MoE``). A model may hold only a range of
layers (a pipeline stage): ``layer_range`` selects them, and only the first stage embeds and only
the last one normalises and projects to logits.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_format import KVFormat
from engine.layers import MLP, MoE, RMSNorm
from engine.mla import MLAttention
from engine.parallel.expert_parallel import ExpertComm, ExpertParallel, ExpertShard
from engine.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kv_format: KVFormat | None = None,
                 experts: ExpertShard | None = None) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, kv_format)
        self.mlp: nn.Module = (MoE(cfg, ExpertParallel(experts) if experts else None) if cfg.is_moe_layer(layer_idx)
                               else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor, rope: RotaryEmbedding
    ) -> torch.Tensor:
        h, x = self.post_attention_layernorm.add_forward(self.self_attn(self.input_layernorm(x), batch, cache, rope), x)
        if isinstance(self.mlp, MoE):
            return x + self.mlp(h, batch.ep_counts)
        return x + self.mlp(h)


class DeepseekModel(nn.Module):
    """The transformer body (``model.*`` keys)."""

    def __init__(self, cfg: ModelConfig, layer_range: range, kv_format: KVFormat | None = None,
                 experts: ExpertShard | None = None) -> None:
        super().__init__()
        self.layer_range = layer_range
        self.is_first = layer_range.start == 0
        self.is_last = layer_range.stop == cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        # A ModuleDict keyed by the global layer index keeps checkpoint names for any stage.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, kv_format, experts) for i in layer_range})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_range: range | None = None, kv_format: KVFormat | None = None,
                 experts: ExpertShard | None = None) -> None:
        """``kv_format``: how the KV cache stores latents (default: in the model's dtype); ``experts``: the
        routed experts this rank holds under expert parallelism (default: all)."""
        super().__init__()
        self.cfg = cfg
        self.experts = experts
        layer_range = layer_range if layer_range is not None else range(cfg.num_hidden_layers)
        self.model = DeepseekModel(cfg, layer_range, kv_format, experts)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.model.is_last else None
        self.rope: RotaryEmbedding | None = None
        self.decode_form = "absorbed"  # decode CUDA graphs are captured in this form only

    def init_rope(self, device: torch.device) -> None:
        cfg = self.cfg
        self.rope = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings, device)

    def forward(
        self, batch: ForwardBatch, kv_caches: dict[int, torch.Tensor], hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run this model's layers. First stage: from ``batch.input_ids``; later stages: from ``hidden``.

        Returns hidden states [T, D] (final-normed on the last stage).
        """
        assert self.rope is not None, "call init_rope() after moving the model to its device"
        if self.model.embed_tokens is not None:
            hidden = self.model.embed_tokens(batch.input_ids)
        assert hidden is not None
        for idx, layer in self.model.layers.items():
            hidden = layer(hidden, batch, kv_caches[int(idx)], self.rope)
        if self.model.norm is not None:
            hidden = self.model.norm(hidden)
        return hidden

    def attach_expert_comm(self, comm: ExpertComm) -> None:
        """Give every expert-parallel MoE layer its group's dispatch and combine (once the group exists)."""
        for layer in self.model.layers.values():
            if isinstance(layer.mlp, MoE) and layer.mlp.ep is not None:
                layer.mlp.ep.comm = comm

    def routed_expert_params(self) -> int:
        """Parameters of the routed experts this model holds (1/EP of them under expert parallelism)."""
        return sum(p.numel() for n, p in self.named_parameters() if n.endswith((".mlp.w13", ".mlp.w2")))

    def expert_collectives(self, ep_counts: list[int]) -> None:
        """A step without rows on one member of an EP group (``engine.parallel.expert_parallel.ExpertGroup``):
        every MoE layer's dispatch and combine, for the other members' rows; nothing else runs."""
        for layer in self.model.layers.values():
            assert isinstance(layer, DecoderLayer)
            if isinstance(layer.mlp, MoE):
                norm = layer.post_attention_layernorm.weight  # the MoE's input: [T, D] in the model's dtype
                layer.mlp(norm.new_empty((0, self.cfg.hidden_size)), ep_counts)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] in fp32."""
        assert self.lm_head is not None
        return self.lm_head(hidden).float()
