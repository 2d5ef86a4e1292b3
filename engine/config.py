"""Model configuration read from a Hugging Face ``config.json`` of a DeepSeek-V2/V3 checkpoint.

Only the fields the MLA engine needs are kept, validated once here so the model code can trust
them. Both spellings of the RoPE block are accepted: ``rope_scaling`` (what checkpoints on the Hub
carry, with ``rope_theta`` beside it) and ``rope_parameters`` (what transformers 5 writes, with
``rope_theta`` inside).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.fp8 import Fp8Config

SUPPORTED_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` "default" or "yarn")."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # Interleaved pairs (x0, x1), (x2, x3)… as DeepSeek checkpoints lay them out; False = NeoX halves.
    interleave: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope type {self.rope_type!r} (supported: default, yarn)")
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if self.rope_type == "yarn" and self.factor <= 0:
            raise ValueError(f"yarn rope factor must be > 0, got {self.factor}")

    @property
    def softmax_mscale(self) -> float:
        """Extra factor on the attention softmax scale (yarn ``mscale_all_dim``), squared by the caller."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extension ``scale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one DeepSeek-V2/V3 style MLA model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = RopeConfig()
    # MoE; n_routed_experts None means every layer is dense.
    n_routed_experts: int | None = None
    num_experts_per_tok: int = 1
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    quantization: Fp8Config | None = None  # block FP8 weights (engine.fp8); None: stored in torch_dtype
    # Multi-token prediction (DeepSeek-V3): layers after the stack (``model.layers.{num_hidden_layers + i}``),
    # each predicting one token further (engine.mtp); speculative decoding drafts with the first.
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be null or > 0, got {self.q_lora_rank}")
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (only silu)")
        if self.n_routed_experts is not None:
            self._validate_moe()

    def _validate_moe(self) -> None:
        assert self.n_routed_experts is not None
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {self.topk_method!r} (supported: {TOPK_METHODS})")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"unsupported scoring_func {self.scoring_func!r} (supported: {SCORING_FUNCS})")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError("moe_intermediate_size must be > 0 for a MoE model")
        if self.moe_layer_freq <= 0:
            raise ValueError(f"moe_layer_freq must be > 0, got {self.moe_layer_freq}")
        if self.topk_method != "greedy":
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_routed_experts {self.n_routed_experts} not divisible by n_group {self.n_group}")
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values per token per layer in the latent cache: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        m = self.rope.softmax_mscale
        return self.qk_head_dim**-0.5 * m * m

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unknown architecture {archs or raw.get('model_type')!r}: "
                f"supported are {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        qc = raw.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise ValueError(f"quantization_config must be an object, got {qc!r}")
        quantization = Fp8Config.from_dict(qc) if qc else None
        required = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        )
        missing = [k for k in required if raw.get(k) is None]
        if missing:
            raise ValueError(f"config.json lacks required MLA fields: {missing}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        is_v3 = SUPPORTED_ARCHITECTURES[arch] == "deepseek_v3"
        n_experts = raw.get("n_routed_experts")
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            q_lora_rank=raw.get("q_lora_rank"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=_rope_from_dict(raw, is_v3),
            n_routed_experts=None if n_experts is None else int(n_experts),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 1),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            # transformers' V3 always routes noaux_tc with sigmoid scores, whatever the file says.
            topk_method=raw.get("topk_method") or ("noaux_tc" if is_v3 else "greedy"),
            scoring_func=raw.get("scoring_func") or ("sigmoid" if is_v3 else "softmax"),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=raw.get("hidden_act", "silu"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            quantization=quantization,
        )


def _rope_from_dict(raw: dict[str, Any], is_v3: bool) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    interleave = bool(raw.get("rope_interleave", True)) if is_v3 else True
    if rope_type == "default":
        return RopeConfig(theta=float(theta), interleave=interleave)
    if "factor" not in params:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params["factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
        ),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 1.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        interleave=interleave,
    )
