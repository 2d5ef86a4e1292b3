"""Load Hugging Face safetensors weights (single file or sharded index) into a DeepseekForCausalLM.

Per-expert tensors (``mlp.experts.{j}.gate_proj.weight`` …, the Hub layout) and transformers-5's fused
expert tensors (``mlp.experts.gate_up_proj`` / ``down_proj``) are both accepted. Every parameter of
the model must be filled with a tensor of the right shape, or loading fails naming the tensor.

A block-FP8 checkpoint (``ModelConfig.quantization``; ``engine.fp8``) stores each quantized weight as
``float8_e4m3fn`` beside its ``weight_scale_inv``: the weight is dequantized into the model's dtype as
it is loaded. An FP8 weight without its scale, a scale of the wrong shape or with values no scale can
have, a scale without an FP8 weight, or FP8 tensors in a checkpoint whose config declares no
quantization fail the load, naming the tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from engine.fp8 import (
    BLOCK,
    FP8_DTYPE,
    SCALE_SUFFIX,
    Fp8Config,
    dequantize_blocks,
    is_quantized_linear,
    quantize_blocks,
)
from engine.fp8_compute import runs_fp8, use_fp8_compute
from engine.kv_format import KVFormat
from engine.layers import MoE
from engine.model import DeepseekForCausalLM, MTPLayer
from engine.parallel.expert_parallel import ExpertShard

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_SHARED = re.compile(r"^mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FUSED = "fused"  # transformers-5's stacked expert tensor [E, ...]: under EP, this rank's rows of it
_SLOTS = "shared:"  # + the projection: a shared expert MLP's tensor split over the stack's shared slots


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_empty_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, layer_range: range | None = None,
    kv_format: KVFormat | None = None, experts: ExpertShard | None = None, mtp: bool = False,
) -> DeepseekForCausalLM:
    """Allocate the model (uninitialised) directly on ``device`` in ``dtype`` (router kept in fp32), its
    attention reading and writing a cache of ``kv_format`` (default: in ``dtype``), holding only the
    routed ``experts`` of its EP rank (default: all), and, with ``mtp``, the multi-token prediction layers (last
    stage). A block-FP8 config on a CUDA device holds the
    routed experts in FP8 (``engine.fp8_compute``); every other FP8 weight is dequantized into ``dtype``."""
    with _default_dtype(dtype), torch.device("meta"):
        model = DeepseekForCausalLM(cfg, layer_range, kv_format, experts, mtp)
        if cfg.quantization is not None and runs_fp8(device):
            use_fp8_compute(model)
    model = model.to_empty(device=device)
    model.init_rope(device)
    return model.eval().requires_grad_(False)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({d / f for f in weight_map.values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"weight files named by the index are missing: {missing}")
    return files


def _target(model: DeepseekForCausalLM, name: str) -> tuple[str, int | None, str | None] | None:
    """Map a checkpoint tensor name to (param name, expert index, part) or None to skip it."""
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    m = _LAYER.match(name)
    if m is None:
        return name, None, None
    layer, rest = int(m.group(1)), m.group(2)
    if layer in model.model.layer_range:
        prefix = f"model.layers.{layer}"
    elif model.mtp is not None and str(layer) in model.mtp:
        prefix = f"mtp.{layer}"  # a multi-token prediction layer (engine.model.MTPLayer)
    else:
        return None  # another pipeline stage's layer, or a multi-token prediction layer not asked for
    e = _EXPERT.match(rest)
    if e is not None:
        part = e.group(2)
        param = ("w2" if part == "down_proj" else "w13") + (e.group(3) or "")
        expert = int(e.group(1))
        if model.experts is not None:  # expert parallelism: only this rank's experts, at their local index
            local = model.experts.local(expert)
            if local is None:
                return None
            expert = local
        elif (moe := _moe(model, f"{prefix}.mlp")) is not None and expert >= moe.routed:
            raise ValueError(f"tensor {name!r}: expert {expert} out of range (n_routed_experts="
                             f"{model.cfg.n_routed_experts})")  # (the stack's shared slots follow the routed)
        return f"{prefix}.mlp.{param}", expert, part
    sh = _SHARED.match(rest)
    if sh is not None:
        moe = _moe(model, f"{prefix}.mlp")
        if moe is not None and moe.shared_slots:  # block FP8: the shared experts are slots of the stack (hold_fp8)
            param = ("w2" if sh.group(1) == "down_proj" else "w13") + (sh.group(2) or "")
            return f"{prefix}.mlp.{param}", moe.routed, _SLOTS + sh.group(1)
    if rest == "mlp.experts.gate_up_proj":
        return f"{prefix}.mlp.w13", None, _FUSED
    if rest == "mlp.experts.down_proj":
        return f"{prefix}.mlp.w2", None, _FUSED
    return f"{prefix}.{rest}", None, None


def _expert_parts(pname: str) -> tuple[str, ...]:
    """The checkpoint's projections an expert stack parameter (w13 / w2, or their scales) holds."""
    return ("down_proj",) if pname.endswith((".w2", ".w2" + SCALE_SUFFIX)) else ("gate_proj", "up_proj")


def _moe(model: DeepseekForCausalLM, name: str) -> MoE | None:
    module = model.get_submodule(name)
    return module if isinstance(module, MoE) else None


def load_weights(model: DeepseekForCausalLM, model_dir: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint in ``model_dir``."""
    params = dict(model.named_parameters())
    filled: set[tuple[str, int | None, str | None]] = set()
    with ExitStack() as stack:
        opened = [(p, stack.enter_context(safe_open(str(p), framework="pt"))) for p in safetensors_files(model_dir)]
        where = {name: (path, f) for path, f in opened for name in f.keys()}  # tensor -> its file
        for name, (path, f) in where.items():
            if name.endswith(SCALE_SUFFIX):
                _check_scale_owner(name, where)
            tgt = _target(model, name)
            if tgt is None:
                continue
            pname, expert, part = tgt
            if name.endswith(SCALE_SUFFIX) and pname not in params:
                continue  # the scale of a weight dequantized at load (CPU, kv_b_proj)
            if pname not in params:
                if pname.startswith(("model.embed_tokens", "model.norm", "lm_head")):
                    continue  # belongs to the first / last stage only
                raise ValueError(f"unexpected tensor {name!r} in {path.name}: no such parameter in the model")
            t = _tensor(model.cfg, name, f, where, raw=_held_fp8(params, pname))
            if part == _FUSED:
                part = None
                if model.experts is not None:
                    t = t[model.experts.start : model.experts.stop]
                moe = _moe(model, pname.rsplit(".", 1)[0])
                if moe is not None and moe.shared_slots:  # the routed experts' rows of the stack, by expert
                    _copy(params[pname][: moe.routed], t, name, None, None)
                    filled.update((pname, e, pt) for e in range(moe.routed) for pt in _expert_parts(pname))
                    continue
            if part is not None and part.startswith(_SLOTS):
                assert expert is not None
                part = part[len(_SLOTS):]
                weight = params[pname.removesuffix(SCALE_SUFFIX)]
                cols = weight.shape[-1] if part == "down_proj" else weight.shape[1] // 2
                for j, piece in enumerate(_slot_pieces(t, weight.shape[0] - expert, cols, part, name)):
                    _copy(params[pname], piece, name, expert + j, part)
                    filled.add((pname, expert + j, part))
                continue
            _copy(params[pname], t, name, expert, part)
            filled.add((pname, expert, part))
    if model.cfg.tie_word_embeddings and "lm_head.weight" in params and "model.embed_tokens.weight" in params:
        if ("lm_head.weight", None, None) not in filled:
            params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
            filled.add(("lm_head.weight", None, None))
    _check_complete(model, params, filled)


def _held_fp8(params: Mapping[str, torch.Tensor], pname: str) -> bool:
    """Whether parameter ``pname`` is an FP8 weight the model computes with, or such a weight's scale."""
    weight = pname[: -len(SCALE_SUFFIX)] if pname.endswith(SCALE_SUFFIX) else pname
    return weight in params and params[weight].dtype == FP8_DTYPE


def _tensor(cfg: ModelConfig, name: str, f: Any, where: Mapping[str, tuple[Path, Any]],
            raw: bool = False) -> torch.Tensor:
    """The checkpoint's tensor ``name``, dequantized (float32) if it is a block-FP8 weight; with ``raw`` (the
    model holds it in FP8) as stored, after the same checks of it and its scale."""
    t = f.get_tensor(name)
    if raw and name.endswith(SCALE_SUFFIX):
        s = t.float()
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise ValueError(f"tensor {name!r} holds scales that are not finite and positive")
        return t
    if raw and t.dtype != FP8_DTYPE:
        raise ValueError(f"tensor {name!r} is {t.dtype}; the FP8 quantization_config says it is FP8 (e4m3) "
                         "with a weight_scale_inv")
    if t.dtype != FP8_DTYPE:
        return t
    if cfg.quantization is None:
        raise ValueError(f"tensor {name!r} is FP8 but config.json declares no quantization_config")
    scale = where.get(name + SCALE_SUFFIX)
    if scale is None:
        raise ValueError(f"tensor {name!r} is FP8 but the checkpoint has no {name + SCALE_SUFFIX!r}")
    if raw:
        return t
    return dequantize_blocks(t, scale[1].get_tensor(name + SCALE_SUFFIX), cfg.quantization.block, name=name)


def _check_scale_owner(scale_name: str, where: Mapping[str, tuple[Path, Any]]) -> None:
    """A scale belongs to an FP8 weight of the same name."""
    weight = scale_name[: -len(SCALE_SUFFIX)]
    owner = where.get(weight)
    if owner is None:
        raise ValueError(f"tensor {scale_name!r} scales {weight!r}, which the checkpoint does not have")
    dtype = owner[1].get_slice(weight).get_dtype()  # safetensors' name of the dtype, from the header
    if dtype != "F8_E4M3":
        raise ValueError(f"tensor {scale_name!r} scales {weight!r}, which is {dtype}, not FP8 (e4m3)")


def _slot_pieces(t: torch.Tensor, slots: int, cols: int, part: str, name: str) -> list[torch.Tensor]:
    """A shared expert MLP's weight (or its scales) split into its ``slots`` experts of ``cols`` columns each:
    gate_proj's and up_proj's rows, down_proj's columns. A slot's scales are the blocks that hold its columns
    (whole blocks each, or one block several slots share: ``MoE.hold_fp8`` holds only such shapes)."""
    dim = 1 if part == "down_proj" else 0
    if name.endswith(SCALE_SUFFIX):
        first = [(j * cols + c) // BLOCK[0] for j in range(slots) for c in range(0, cols, BLOCK[0])]
        rows = torch.tensor(first, dtype=torch.long).view(slots, -1)
        if t.shape[dim] != -(-slots * cols // BLOCK[0]):
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}: not the blocks of {slots} shared "
                             f"experts of {cols} columns along dimension {dim}")
        return [t.index_select(dim, r) for r in rows]
    if t.shape[dim] != slots * cols:
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}; the config implies {slots * cols} columns "
                         f"along dimension {dim} ({slots} shared experts of {cols})")
    return list(t.chunk(slots, dim))


def _copy(param: torch.Tensor, t: torch.Tensor, name: str, expert: int | None, part: str | None) -> None:
    if expert is None:
        dst = param
    else:
        if expert >= param.shape[0]:
            raise ValueError(f"tensor {name!r}: expert {expert} out of range (n_routed_experts={param.shape[0]})")
        dst = param[expert]
        if part in ("gate_proj", "up_proj"):
            half = dst.shape[0] // 2
            dst = dst[:half] if part == "gate_proj" else dst[half:]
    if tuple(t.shape) != tuple(dst.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {tuple(dst.shape)}")
    dst.copy_(t.to(dst.dtype))


def _check_complete(
    model: DeepseekForCausalLM, params: Mapping[str, torch.Tensor], filled: set[tuple[str, int | None, str | None]]
) -> None:
    missing = []
    for pname, p in params.items():
        if (pname, None, None) in filled:
            continue
        if pname.endswith((".w13", ".w2", ".w13" + SCALE_SUFFIX, ".w2" + SCALE_SUFFIX)):
            scale = SCALE_SUFFIX if pname.endswith(SCALE_SUFFIX) else ""
            absent = [(e, pt) for e in range(p.shape[0]) for pt in _expert_parts(pname) if (pname, e, pt) not in filled]
            if not absent:
                continue
            layer = pname.split(".mlp.")[0].rsplit(".", 1)[1]  # model.layers.{i}.mlp.w13 / mtp.{i}.mlp.w13
            moe = _moe(model, pname.rsplit(".", 1)[0])
            routed = moe.routed if moe is not None else p.shape[0]  # then the shared experts' slots
            missing += list(dict.fromkeys(  # (each shared tensor once, in the experts' order)
                f"model.layers.{layer}.mlp." + (f"experts.{e}" if e < routed else "shared_experts")
                + f".{pt}.weight{scale}" for e, pt in absent))
        else:
            missing.append(pname)
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {missing[:8]}{more}")


_Table = nn.Embedding | nn.Linear


def _mtp_copies(model: DeepseekForCausalLM) -> list[tuple[_Table, _Table]]:
    """(an MTP layer's embedding or shared head, the model's own table it copies): DeepSeek's checkpoints store
    both again under ``model.layers.{N}`` (``embed_tokens``, ``shared_head.head``). Only where this rank holds
    the model's table too (the embedding: the first stage; the head: the last)."""
    if model.mtp is None:
        return []
    pairs: list[tuple[_Table, _Table]] = []
    for layer in model.mtp.values():
        assert isinstance(layer, MTPLayer)
        if model.model.embed_tokens is not None:
            pairs.append((layer.embed_tokens, model.model.embed_tokens))
        if model.lm_head is not None:
            pairs.append((layer.shared_head.head, model.lm_head))
    return pairs


def share_mtp_tables(model: DeepseekForCausalLM) -> int:
    """Each MTP table (``_mtp_copies``) that holds exactly the model's own becomes the model's tensor, as vLLM
    shares them: held once, the copy's memory goes to the KV cache (DeepSeek-V3's two 129,280 x 7,168 tables are
    3.7 GB in bf16 on each rank with the MTP layer). A checkpoint whose MTP tables differ keeps them. Returns
    how many were shared."""
    shared = 0
    for mod, own in _mtp_copies(model):
        mine, theirs = mod.weight, own.weight
        if mine is not theirs and mine.shape == theirs.shape and mine.dtype == theirs.dtype \
                and torch.equal(mine, theirs):
            mod.weight = theirs
            shared += 1
    return shared


def init_random_weights(model: DeepseekForCausalLM, seed: int = 0) -> None:
    """Dummy weights (vLLM's ``load_format="dummy"``): for benchmarks of real-size shapes without files. With
    an FP8 config every weight DeepSeek quantizes goes through our block quantizer: held in FP8 (with its
    scales) where the model computes in FP8, else back into the model's dtype, so it holds what such a
    checkpoint's weights load to (values on each block's e4m3 grid)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    fp8 = model.cfg.quantization
    params = dict(model.named_parameters())
    copies = {id(mod.weight) for mod, _ in _mtp_copies(model)}  # copied from the model's tables below
    for name, p in params.items():
        if id(p) in copies:
            continue
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            p.zero_()
        elif name.endswith(SCALE_SUFFIX):
            continue  # filled with its weight
        elif name.endswith("mlp.gate.weight"):  # bf16 values, as checkpoints store the router
            p.copy_(p.normal_(0.0, p.shape[-1] ** -0.5, generator=g).to(torch.bfloat16))
        elif p.dtype == FP8_DTYPE:
            assert fp8 is not None
            for m, scale in _fp8_matrices(p, params[name + SCALE_SUFFIX], name):
                w = torch.empty(m.shape, dtype=torch.float32, device=m.device).normal_(0.0, m.shape[-1] ** -0.5,
                                                                                      generator=g)
                q, s = quantize_blocks(w, fp8.block, fp8.ue8m0)
                m.copy_(q)
                scale.copy_(s)
        else:
            fan_in = p.shape[-1]
            p.normal_(0.0, fan_in**-0.5, generator=g)
            if fp8 is not None:
                _round_to_fp8(p, name, fp8)
    for mod, own in _mtp_copies(model):  # copies of the model's tables, as checkpoints store them
        mod.weight.copy_(own.weight)


def _fp8_matrices(p: torch.Tensor, scale: torch.Tensor, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The checkpoint's matrices in the parameter ``p`` with their scales: a linear's one, or a stack of
    experts' one per expert and projection (w13: gate_proj's, then up_proj's)."""
    if name.endswith(".mlp.w13"):
        return [(m, s) for e in range(p.shape[0]) for m, s in zip(p[e].chunk(2), scale[e].chunk(2))]
    if name.endswith(".mlp.w2"):
        return [(p[e], scale[e]) for e in range(p.shape[0])]
    return [(p, scale)]


def _round_to_fp8(p: torch.Tensor, name: str, fp8: Fp8Config) -> None:
    """``p`` (a parameter named ``name``) as its FP8 checkpoint tensors would load dequantized, where
    DeepSeek's FP8 checkpoints quantize it: stacked experts one expert and one projection at a time."""
    block, ue8m0 = fp8.block, fp8.ue8m0
    if name.endswith((".mlp.w13", ".mlp.w2")):
        mats = [half for e in p for half in (e.chunk(2) if name.endswith(".w13") else (e,))]
    elif is_quantized_linear(name):
        mats = [p]
    else:
        return
    for m in mats:
        q, s = quantize_blocks(m, block, ue8m0)
        m.copy_(dequantize_blocks(q, s, block, m.dtype))
