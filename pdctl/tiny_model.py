"""Generate a tiny, random, seed-deterministic DeepSeek-V2/V3 (MLA) model directory.

The directory looks like a Hugging Face Hub checkpoint of DeepSeek-V2/V3 (``config.json`` with
``rope_scaling``, one ``model.safetensors`` with per-expert tensor names, a byte-level BPE
``tokenizer.json`` with DeepSeek special tokens and chat template), small enough to run on a CPU in
milliseconds. Weights are scaled so that logits are far from flat (std of about 4 over the vocabulary),
which keeps greedy decoding stable across implementations.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.fp8 import SCALE_SUFFIX, Fp8Config, is_quantized_linear, quantize_blocks
from pdctl.tiny_corpus import CORPUS

__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "USER_TOKEN",
    "make_tiny_model",
]

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
_SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]
_TARGET_VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER_TOKEN + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + ASSISTANT_TOKEN + "' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT_TOKEN + "' }}{% endif %}"
)

# Target standard deviation of the logits over the vocabulary for a unit-RMS final hidden state.
_LOGIT_STD = 4.0
# Router logits std (for a unit-RMS input); large enough that top-k routing has clear margins.
_ROUTER_STD = 2.0


def _build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer on the inline corpus (deterministic, no network)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS), trainer=trainer, length=len(CORPUS))
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Same template transformers builds from ``add_bos_token: true``, so both stacks agree.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _build_config(arch: str, moe: bool, num_layers: int, vocab_size: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    """Return the Hub-style ``config.json`` dict (before ``overrides``)."""
    v3 = arch == "v3"
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128 if v3 else None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
    }
    if v3:
        cfg.update(
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            topk_method="noaux_tc",
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            scoring_func="sigmoid",
            rope_interleave=True,
        )
    else:
        cfg.update(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            scoring_func="softmax",
        )
    if not moe:
        # Every layer dense. The key is omitted rather than written as null: transformers 5's strict
        # config dataclass rejects ``n_routed_experts: null`` (it must be an int). Readers of the raw
        # JSON see ``cfg.get("n_routed_experts") is None``; transformers falls back to its default
        # but builds no MoE layer because first_k_dense_replace == num_hidden_layers.
        del cfg["n_routed_experts"]
        cfg["first_k_dense_replace"] = num_layers
    return cfg


def _is_moe_layer(cfg: dict[str, Any], i: int) -> bool:
    """Whether layer ``i`` is a MoE layer (the rule vLLM and the DeepSeek reference code use)."""
    return (
        cfg.get("n_routed_experts") is not None
        and i >= cfg.get("first_k_dense_replace", 0)
        and i % cfg.get("moe_layer_freq", 1) == 0
    )


def _weight_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """List ``(name, shape, init_kind)`` for every tensor, in the fixed generation order."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_rank, q_rank = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (cfg["vocab_size"], h), "embed")]

    def mlp(prefix: str, inter: int) -> None:
        specs.append((f"{prefix}.gate_proj.weight", (inter, h), "linear"))
        specs.append((f"{prefix}.up_proj.weight", (inter, h), "linear"))
        specs.append((f"{prefix}.down_proj.weight", (h, inter), "linear"))

    def layer(i: int) -> None:
        p = f"model.layers.{i}"
        specs.append((f"{p}.input_layernorm.weight", (h,), "norm"))
        if q_rank is None:
            specs.append((f"{p}.self_attn.q_proj.weight", (heads * (nope + rope), h), "linear"))
        else:
            specs.append((f"{p}.self_attn.q_a_proj.weight", (q_rank, h), "linear"))
            specs.append((f"{p}.self_attn.q_a_layernorm.weight", (q_rank,), "norm"))
            specs.append((f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank), "linear"))
        specs.append((f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, h), "linear"))
        specs.append((f"{p}.self_attn.kv_a_layernorm.weight", (kv_rank,), "norm"))
        specs.append((f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + vdim), kv_rank), "linear"))
        specs.append((f"{p}.self_attn.o_proj.weight", (h, heads * vdim), "linear"))
        specs.append((f"{p}.post_attention_layernorm.weight", (h,), "norm"))
        if _is_moe_layer(cfg, i):
            n_exp, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            specs.append((f"{p}.mlp.gate.weight", (n_exp, h), "router"))
            if cfg.get("topk_method") == "noaux_tc":
                specs.append((f"{p}.mlp.gate.e_score_correction_bias", (n_exp,), "bias"))
            for j in range(n_exp):
                mlp(f"{p}.mlp.experts.{j}", inter)
            if cfg.get("n_shared_experts"):
                mlp(f"{p}.mlp.shared_experts", inter * cfg["n_shared_experts"])
        else:
            mlp(f"{p}.mlp", cfg["intermediate_size"])

    n = cfg["num_hidden_layers"]
    for i in range(n):
        layer(i)
    specs.append(("model.norm.weight", (h,), "norm"))
    specs.append(("lm_head.weight", (cfg["vocab_size"], h), "lm_head"))
    # Multi-token prediction layers last (the tensors before them keep their values), in DeepSeek-V3's
    # layout: a decoder layer with enorm, hnorm, eh_proj, and copies of the embedding and the head.
    for i in range(n, n + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{i}"
        specs += [(f"{p}.enorm.weight", (h,), "norm"), (f"{p}.hnorm.weight", (h,), "norm"),
                  (f"{p}.eh_proj.weight", (h, 2 * h), "linear")]
        layer(i)
        specs += [(f"{p}.shared_head.norm.weight", (h,), "norm"),
                  (f"{p}.shared_head.head.weight", (cfg["vocab_size"], h), "copy:lm_head.weight"),
                  (f"{p}.embed_tokens.weight", (cfg["vocab_size"], h), "copy:model.embed_tokens.weight")]
    return specs


def _make_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Draw every tensor from one seeded CPU generator, in the order of :func:`_weight_specs`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = cfg["hidden_size"]
    out: dict[str, torch.Tensor] = {}
    for name, shape, kind in _weight_specs(cfg):
        if kind.startswith("copy:"):  # shared with the main model; the checkpoint stores a copy
            out[name] = out[kind.removeprefix("copy:")].clone()
            continue
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "linear":
            x = x * (1.0 / math.sqrt(shape[-1]))
        elif kind == "norm":
            x = 1.0 + 0.1 * x
        elif kind == "lm_head":
            x = x * (_LOGIT_STD / math.sqrt(hidden))
        elif kind == "router":
            x = x * (_ROUTER_STD / math.sqrt(hidden))
        elif kind == "bias":
            x = 0.1 * x
        out[name] = x.contiguous()
    return out


def _quantized(cfg: dict[str, Any], weights: dict[str, torch.Tensor], method: str,
               scale_fmt: str | None) -> dict[str, torch.Tensor]:
    """``weights`` in a block-FP8 checkpoint's tensors; ``cfg`` gains its ``quantization_config``."""
    if method != "fp8":
        raise ValueError(f"quantize must be 'fp8', got {method!r}")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"scale_fmt must be ue8m0 or none, got {scale_fmt!r}")
    fp8 = Fp8Config(ue8m0=scale_fmt == "ue8m0")
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if is_quantized_linear(name):
            out[name], out[name + SCALE_SUFFIX] = quantize_blocks(w, fp8.block, fp8.ue8m0)
        else:
            out[name] = w
    cfg["quantization_config"] = fp8.to_dict()
    return out


def pad_vocabulary(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """The tokenizer with its BPE vocabulary padded to ``vocab_size`` by tokens `` t<id>`` that no merge
    produces: text encodes as before, and every id a model of that vocabulary samples decodes to text."""
    raw = json.loads(tok.to_str())
    vocab = raw["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in raw.get("added_tokens", [])}
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"\u0120t{i}"] = i  # "Ġ" is the byte-level space
    return Tokenizer.from_str(json.dumps(raw))


def write_config_only(out_dir: str | Path, config: dict[str, Any]) -> Path:
    """A model directory with ``config`` (a Hugging Face config dict, e.g. DeepSeek-V2-Lite's) and the tiny
    model's tokenizer padded to its vocabulary, but no weights: for clusters on ``load_format: dummy``
    (benchmarks on GPUs at a real model's shape)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = pad_vocabulary(_build_tokenizer(), int(config["vocab_size"]))
    bos_id, eos_id = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    cfg = {**config, "bos_token_id": bos_id, "eos_token_id": eos_id}
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    _write_tokenizer(out, tok, cfg)
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` as stable, sorted, indented UTF-8 JSON."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "v2",
    moe: bool = True,
    seed: int = 0,
    num_layers: int = 3,
    overrides: dict | None = None,
    quantize: str | None = None,
    scale_fmt: str | None = None,
    mtp_layers: int = 0,
) -> Path:
    """Write a tiny random DeepSeek model directory and return its path.

    Args:
        out_dir: Directory to create (or overwrite files in).
        arch: ``"v2"`` (DeepseekV2ForCausalLM, no q-LoRA, softmax/greedy routing) or ``"v3"``
            (DeepseekV3ForCausalLM, q_lora_rank 128, sigmoid/noaux_tc grouped routing).
        moe: ``True`` for MoE layers after the first (dense) layer, ``False`` for all-dense MLPs.
        seed: Seed of the torch generator that draws every weight; equal seeds give identical bytes.
        num_layers: Number of decoder layers.
        overrides: Applied last to the config dict (e.g. ``{"hidden_size": 128}``); the weights
            follow the overridden shapes.
        quantize: ``"fp8"``: the linears DeepSeek quantizes are written in its block-FP8 format
            (``engine.fp8``: e4m3 in 128 x 128 blocks, a ``weight_scale_inv`` each, and the config's
            ``quantization_config``), quantized from the same random weights.
        scale_fmt: with ``quantize``: ``"ue8m0"`` for power-of-two scales (DeepSeek-V3.1's).
        mtp_layers: multi-token prediction layers after the stack (``num_nextn_predict_layers``, DeepSeek-V3's
            layout); drawn after every other tensor, so the rest equal a model without them.

    Returns:
        The output directory, containing ``config.json``, ``generation_config.json``,
        ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.
    """
    if arch not in ("v2", "v3"):
        raise ValueError(f"arch must be 'v2' or 'v3', got {arch!r}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = _build_tokenizer()
    bos_id, eos_id = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    assert bos_id is not None and eos_id is not None  # both are special tokens of the trained vocabulary
    cfg = _build_config(arch, moe, num_layers, tok.get_vocab_size(), bos_id, eos_id)
    if mtp_layers < 0:
        raise ValueError(f"mtp_layers must be >= 0, got {mtp_layers}")
    if mtp_layers:
        cfg["num_nextn_predict_layers"] = mtp_layers
    cfg.update(overrides or {})
    weights = _make_weights(cfg, seed)
    if quantize is not None:
        weights = _quantized(cfg, weights, quantize, scale_fmt)
    elif scale_fmt is not None:
        raise ValueError("scale_fmt needs quantize")

    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    _write_tokenizer(out, tok, cfg)
    return out


def _write_tokenizer(out: Path, tok: Tokenizer, cfg: dict[str, Any]) -> None:
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "unk_token": None,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": cfg.get("max_position_embeddings", 4096),
            "chat_template": CHAT_TEMPLATE,
        },
    )
