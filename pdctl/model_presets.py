"""Published model shapes, for ``pdctl make-model --preset NAME --config-only`` and the benchmarks.

Only the shapes matter: clusters and benchmarks run them on dummy weights (``load_format: dummy``).
"""

from __future__ import annotations

from typing import Any

from engine.fp8 import Fp8Config

# DeepSeek-V2-Lite's published shape (random weights: only the shapes matter for speed).
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
}

# DeepSeek-V3's published shape (V3, R1 and V3.1 share it); 61 layers do not fit one GPU: benchmarks take
# a few of them (benchmarks/engine.py --preset v3 --layers N).
V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}

PRESETS = {"v2-lite": V2_LITE, "v3": V3}


def preset_config(name: str, quantize: str | None = None, scale_fmt: str | None = None,
                  num_layers: int | None = None) -> dict[str, Any]:
    """Preset ``name``'s config, with block-FP8's ``quantization_config`` for ``quantize="fp8"`` (``scale_fmt``
    ue8m0: power-of-two scales) and ``num_layers`` decoder layers instead of the published count."""
    cfg = dict(PRESETS[name])
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantize must be fp8 or none, got {quantize!r}")
    if quantize is not None:
        cfg["quantization_config"] = Fp8Config(ue8m0=scale_fmt == "ue8m0").to_dict()
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        cfg["num_hidden_layers"] = num_layers
    return cfg
