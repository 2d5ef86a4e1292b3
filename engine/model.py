"""DeepSeek-V2/V3 decoder stack over a paged latent KV cache.

Parameter names equal the Hugging Face checkpoint keys (``model.layers.{i}.self_attn.kv_b_proj.weight``
…) except the stacked routed experts (see ``engine.layers.MoE``). A model may hold only a range of
layers (a pipeline stage): ``layer_range`` selects them, and only the first stage embeds and only
the last one normalises and projects to logits.

DeepSeek-V3's multi-token prediction (MTP) layers (``num_nextn_predict_layers``) sit after the stack in the
checkpoint (``model.layers.{N}``, N = ``num_hidden_layers`` for the first): each is a decoder layer with
``enorm`` and ``hnorm`` (RMSNorms), ``eh_proj`` [D, 2D], ``shared_head.norm`` and ``shared_head.head`` (an
LM head) and ``embed_tokens`` (a copy of the model's embedding). The last stage holds them (``MTPLayer``,
parameters ``mtp.{N}.*``; ``engine.weights`` maps the keys) when asked to. At row i of a step the layer
takes the target's final-normed hidden state of position i and the token at position i + 1, and its
logits predict the token at position i + 2:

    x = eh_proj([enorm(embed(token[i + 1])); hnorm(hidden[i])])
    h = decoder_layer(x)            at position i, with a KV cache of its own (cache layer N)
    logits = head(norm(h))

For tokens further ahead the same layer runs again on its own ``h`` and the token it predicted (as vLLM
and SGLang use DeepSeek's one layer).
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
            return x + self.mlp(h, batch.ep_counts, batch.static)
        return x + self.mlp(h)


def _moe_collectives(layer: DecoderLayer, ep_counts: list[int]) -> None:
    """The layer's MoE run without rows (its EP dispatch and combine only); nothing for a dense layer."""
    if isinstance(layer.mlp, MoE):
        norm = layer.post_attention_layernorm.weight  # the MoE's input: [T, D] in the model's dtype
        layer.mlp(norm.new_empty((0, norm.shape[0])), ep_counts)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


def uninitialised_embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding`` without its random init: the model is built on the meta device and its weights loaded after
    (``weights.build_empty_model``), and the init's ``normal_`` on a meta tensor imports ``torch._dynamo``,
    ~1.5 s of every engine and rank process's start."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class MTPLayer(DecoderLayer):
    """One multi-token prediction layer (module docstring): a decoder layer and what feeds and reads it."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, kv_format: KVFormat | None = None,
                 experts: ExpertShard | None = None) -> None:
        super().__init__(cfg, layer_idx, kv_format, experts)
        d = cfg.hidden_size
        self.embed_tokens = uninitialised_embedding(cfg.vocab_size, d)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(cfg)

    def predict(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor,
                rope: RotaryEmbedding) -> torch.Tensor:
        """next_ids [T]: the token after each row's; hidden [T, D]: the previous depth's hidden state at each
        row -> this layer's hidden state [T, D] (before the shared head's norm). ``batch``: the rows'
        positions and where this layer's KV goes in ``cache``, as for every layer."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)], dim=-1))
        return self(x, batch, cache, rope)

    def expert_collectives(self, ep_counts: list[int]) -> None:
        """A pass of this layer without rows on one member of an EP group: its MoE's dispatch and combine, for
        the other members' rows (``ModelRunner.draft``)."""
        _moe_collectives(self, ep_counts)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] (this layer's) -> logits [N, V] in fp32."""
        return self.shared_head.head(self.shared_head.norm(hidden)).float()


class DeepseekModel(nn.Module):
    """The transformer body (``model.*`` keys)."""

    def __init__(self, cfg: ModelConfig, layer_range: range, kv_format: KVFormat | None = None,
                 experts: ExpertShard | None = None) -> None:
        super().__init__()
        self.layer_range = layer_range
        self.is_first = layer_range.start == 0
        self.is_last = layer_range.stop == cfg.num_hidden_layers
        self.embed_tokens = uninitialised_embedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        # A ModuleDict keyed by the global layer index keeps checkpoint names for any stage.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, kv_format, experts) for i in layer_range})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_range: range | None = None, kv_format: KVFormat | None = None,
                 experts: ExpertShard | None = None, mtp: bool = False) -> None:
        """``kv_format``: how the KV cache stores latents (default: in the model's dtype); ``experts``: the
        routed experts this rank holds under expert parallelism (default: all); ``mtp``: hold the model's
        multi-token prediction layers too (the last stage only)."""
        super().__init__()
        self.cfg = cfg
        self.experts = experts
        layer_range = layer_range if layer_range is not None else range(cfg.num_hidden_layers)
        self.model = DeepseekModel(cfg, layer_range, kv_format, experts)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.model.is_last else None
        n = cfg.num_hidden_layers
        if mtp and not cfg.num_nextn_predict_layers:
            raise ValueError("the model has no multi-token prediction layer (num_nextn_predict_layers is 0)")
        self.mtp = nn.ModuleDict({str(i): MTPLayer(cfg, i, kv_format, experts)
                                  for i in range(n, n + cfg.num_nextn_predict_layers)}) \
            if mtp and self.model.is_last else None
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
        """Give every expert-parallel MoE layer (the MTP layer's too) its group's dispatch and combine (once the
        group exists)."""
        mtp = list(self.mtp.values()) if self.mtp is not None else []
        for layer in [*self.model.layers.values(), *mtp]:
            if isinstance(layer.mlp, MoE) and layer.mlp.ep is not None:
                layer.mlp.ep.comm = comm

    def routed_expert_params(self) -> int:
        """Parameters of the routed experts this model holds (1/EP of them under expert parallelism)."""
        return sum(m.routed_params() for m in self.modules() if isinstance(m, MoE))

    def expert_collectives(self, ep_counts: list[int]) -> None:
        """An eager step without rows on one member of an EP group (``engine.parallel.expert_parallel.ExpertGroup``):
        every MoE layer's dispatch and combine, for the other members' rows; nothing else runs. (A step the
        group replays as a CUDA graph such a member replays with padding rows: ``DecodeGraphs.pad``.)"""
        for layer in self.model.layers.values():
            assert isinstance(layer, DecoderLayer)
            _moe_collectives(layer, ep_counts)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] in fp32."""
        assert self.lm_head is not None
        return self.lm_head(hidden).float()
