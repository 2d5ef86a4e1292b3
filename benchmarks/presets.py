"""Model shapes and FLOP counts shared by the benchmarks."""

from __future__ import annotations

from typing import Any

from engine.config import ModelConfig
from pdctl.model_presets import V2_LITE  # noqa: F401  (re-exported: the benchmarks' model shape)

# A medium JSON schema (nested object, array, enum, bounded strings, numbers): structured output's cost.
MEDIUM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 40},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 32}, "city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "score", "active", "tags", "address"],
    "additionalProperties": False,
}

H200_BF16_PEAK_TFLOPS = 989.0  # dense bf16 tensor-core peak (datasheet), the MFU denominator
H200_FP8_PEAK_TFLOPS = 1979.0  # dense FP8 tensor-core peak (datasheet)


def prefill_flops(cfg: ModelConfig, t: int) -> float:
    """Matmul FLOPs of one t-token causal prefill (router, norms and the single lm_head row ignored)."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    attn_proj = h * nh * cfg.qk_head_dim + h * cfg.kv_cache_dim + cfg.kv_lora_rank * nh * (
        cfg.qk_nope_head_dim + cfg.v_head_dim) + nh * cfg.v_head_dim * h
    dense_mlp = 3 * h * cfg.intermediate_size
    moe_mlp = 3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    per_token = 0
    for i in range(cfg.num_hidden_layers):
        per_token += attn_proj + (moe_mlp if cfg.is_moe_layer(i) else dense_mlp)
    # causal attention: QK^T and PV over t^2/2 pairs per head
    attn = cfg.num_hidden_layers * nh * (t * t / 2) * (cfg.qk_head_dim + cfg.v_head_dim)
    return 2.0 * (per_token * t + attn)


H200_HBM_TB_S = 4.8  # HBM3e bandwidth (datasheet), the memory-roofline denominator


def decode_step_bytes(cfg: ModelConfig, batch: int, context: int, elem: int = 2,
                      kv_row_bytes: int | None = None, expert_elem: float | None = None) -> float:
    """Bytes one decode step must read at least: every weight it uses once (routed experts: the expected
    number of distinct experts that ``batch`` tokens choose uniformly, E(1 - (1 - K/E)^B)), plus each
    row's latent cache (``context`` tokens x (kv_lora_rank + rope) per layer). Embedding rows, norms and
    activations are left out (small). ``kv_row_bytes``: one cached token's row per layer (default: the
    latent in ``elem``-byte values; an FP8 cache's, engine.kv_format). ``expert_elem``: bytes per routed and shared
    expert weight (default ``elem``; a block-FP8 checkpoint's experts: 1, their scales 4 bytes per 128 x 128 block
    left out, as the engine keeps its other FP8 weights dequantized)."""
    row = cfg.kv_cache_dim * elem if kv_row_bytes is None else kv_row_bytes
    ex = elem if expert_elem is None else expert_elem
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = h * nh * cfg.qk_head_dim
    else:
        q = h * cfg.q_lora_rank + cfg.q_lora_rank * nh * cfg.qk_head_dim
    kv_b = cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    attn = q + h * cfg.kv_cache_dim + kv_b + nh * cfg.v_head_dim * h
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        total += attn * elem + batch * context * row
        if cfg.is_moe_layer(i):
            e, k = cfg.n_routed_experts or 0, cfg.num_experts_per_tok
            used = e * (1 - (1 - k / e) ** batch)
            total += (used + cfg.n_shared_experts) * 3 * h * cfg.moe_intermediate_size * ex + e * h * 4
        else:
            total += 3 * h * cfg.intermediate_size * elem
    return total + cfg.vocab_size * h * elem  # lm_head
