"""Building blocks of a DeepSeek decoder layer other than attention: RMSNorm, dense MLP, routed MoE.

Parameter names mirror the Hugging Face checkpoints so ``state_dict`` keys equal the file's keys,
except the routed experts, which are stacked per layer (``w13`` = gate and up, ``w2`` = down) so one
module owns them; the weight loader stacks the per-expert tensors.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine import expert_choice, moe_kernels, norm_kernels
from engine.config import ModelConfig
from engine.fp8 import BLOCK, FP8_DTYPE, scale_shape
from engine.parallel.expert_parallel import ExpertParallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm_kernels.supported(x) and x.dim() == 2 and x.stride(-1) == 1:
            return norm_kernels.rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): one kernel on CUDA."""
        if norm_kernels.supported(x) and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1:
            normed, summed = norm_kernels.rms_norm(x, self.weight, self.eps, residual=residual)
            assert summed is not None
            return normed, summed
        summed = x + residual
        return self(summed), summed


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Top-k expert selection: V2 softmax (greedy / group-limited) or V3 sigmoid with ``noaux_tc``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.n_routed_experts is not None
        self.cfg = cfg
        self.num_experts = cfg.n_routed_experts
        # The router runs in fp32 whatever the model dtype (as the reference implementations do): its logits are
        # fp32 sums of the exact products of the input and the weight (see ``hold_bf16``).
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size, dtype=torch.float32))
        self.bf16 = False  # the weight held in bf16, exactly (``hold_bf16``)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32))

    def hold_bf16(self) -> bool:
        """Where every weight is a bf16 value (checkpoints store the gate in bf16), hold it in bf16: a bf16
        input's logits then come from one bf16 GEMM that accumulates in fp32 (``torch.mm``'s ``out_dtype``,
        CUDA): the same exact products and fp32 sums as the fp32 GEMM, in another order, without the input's
        cast and cuBLAS's fp32 SIMT kernel. Returns whether it did (not where bf16 would round a weight)."""
        w16 = self.weight.detach().to(torch.bfloat16)
        if self.weight.device.type != "cuda" or not torch.equal(w16.float(), self.weight.detach()):
            return False
        self.weight.data = w16
        self.bf16 = True
        return True

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> fp32 [T, E]."""
        if self.bf16 and x.dtype == torch.bfloat16:
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())

    def _group_mask(self, choice: torch.Tensor, group_score: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        group_idx = torch.topk(group_score, k=cfg.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_score).scatter_(1, group_idx, 1.0)
        per_group = self.num_experts // cfg.n_group
        return group_mask.unsqueeze(-1).expand(-1, cfg.n_group, per_group).reshape(choice.shape).bool()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, K] fp32, expert ids [T, K])."""
        cfg = self.cfg
        logits = self.logits(x)  # [T, E]
        if expert_choice.usable(logits, cfg.topk_method):  # on CUDA: the rest in one kernel
            bias = self.e_score_correction_bias if cfg.topk_method == "noaux_tc" else None
            return expert_choice.choose(logits, cfg.num_experts_per_tok, sigmoid=cfg.scoring_func == "sigmoid",
                                        method=cfg.topk_method, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                        bias=bias, norm=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        per_group = self.num_experts // cfg.n_group
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
            group_score = choice.view(-1, cfg.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
            choice = choice.masked_fill(~self._group_mask(choice, group_score), float("-inf"))
            ids = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        elif cfg.topk_method == "group_limited_greedy":
            group_score = scores.view(-1, cfg.n_group, per_group).max(dim=-1).values
            masked = scores.masked_fill(~self._group_mask(scores, group_score), 0.0)
            weights, ids = torch.topk(masked, k=cfg.num_experts_per_tok, dim=-1, sorted=False)
        else:
            weights, ids = torch.topk(scores, k=cfg.num_experts_per_tok, dim=-1, sorted=False)
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts (stacked weights) plus always-on shared experts. With ``ep`` (expert parallelism) the
    stack holds only this rank's shard of the experts, and ``forward`` dispatches over the EP group."""

    def __init__(self, cfg: ModelConfig, ep: ExpertParallel | None = None) -> None:
        super().__init__()
        assert cfg.n_routed_experts is not None
        self.ep = ep
        e, h, i = ep.shard.per_rank if ep else cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))  # per expert: cat(gate_proj, up_proj)
        self.w2 = nn.Parameter(torch.empty(e, h, i))  # per expert: down_proj
        self.shared_experts = MLP(h, i * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.routed = e  # the stack's first ``routed`` entries are the experts the router picks
        self.shared_slots = 0  # then this many hold the shared experts (block FP8: ``hold_fp8``)
        self.w13_scale_inv: nn.Parameter | None
        self.w2_scale_inv: nn.Parameter | None
        self.register_parameter("w13_scale_inv", None)  # block FP8 experts only (hold_fp8)
        self.register_parameter("w2_scale_inv", None)

    def hold_fp8(self) -> None:
        """Hold the routed experts in block FP8: w13 / w2 in e4m3 and each expert's ``weight_scale_inv``
        stacked the same way (``w13_scale_inv`` [E, 2 * cdiv(I, 128), cdiv(D, 128)]: gate_proj's blocks, then
        up_proj's; ``w2_scale_inv`` [E, cdiv(D, 128), cdiv(I, 128)]), run by the fused W8A8 kernels. Under
        expert parallelism E is this rank's share.

        The shared experts (an MLP of ``n_shared_experts * I`` columns) join the stack as that many more
        experts of I columns each, which every token chooses with weight 1: the same kernels read them in
        FP8 in the same launches, where a separate bf16 MLP read twice the bytes in three more GEMMs (the
        gain per layer and step: docs/benchmarks.md). Splitting the
        MLP's columns is exact (silu(gate) * up is per column and the down projection sums over them), and
        so are its scales where each slot's columns fill whole 128-blocks or lie in one (I a multiple or a
        divisor of 128). Under expert parallelism the slots follow this rank's shard of the routed experts, and
        each rank runs them on its own rows (``_shared_sums``), so every topology computes them alike."""
        e, two_i, d = self.w13.shape
        i = two_i // 2
        dev = self.w13.device
        if self.shared_experts is not None and (i % BLOCK[0] == 0 or BLOCK[0] % i == 0):
            self.shared_slots = self.shared_experts.gate_proj.out_features // i
            self.shared_experts = None
            e += self.shared_slots
        gi, gd = scale_shape((i, d))
        self.w13 = nn.Parameter(torch.empty(e, two_i, d, dtype=FP8_DTYPE, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, d, i, dtype=FP8_DTYPE, device=dev), requires_grad=False)
        self.w13_scale_inv = nn.Parameter(torch.empty(e, 2 * gi, gd, dtype=torch.float32, device=dev),
                                          requires_grad=False)
        self.w2_scale_inv = nn.Parameter(torch.empty(e, gd, gi, dtype=torch.float32, device=dev), requires_grad=False)

    def forward(self, x: torch.Tensor, ep_counts: list[int] | None = None, static: bool = False) -> torch.Tensor:
        """x: [T, D] -> [T, D]. ``ep_counts``: every EP rank's rows this step (expert parallelism); ``static``: a
        CUDA graph's step (``ForwardBatch.static``: fixed shapes, nothing read back to the host)."""
        if self.ep is not None and self.ep.comm is not None:
            if ep_counts is None:
                raise RuntimeError("an expert-parallel MoE layer needs the EP group's row counts")
            return self._forward_ep(x, ep_counts, static)
        if x.shape[0] == 0:  # a PCP rank with no rows this step
            return x.clone()
        weights, ids = self.gate(x)  # [T, K]
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.w13_scale_inv is not None:  # block FP8: the fused W8A8 kernels at every size (shared slots too)
            return moe_kernels.experts_sum(x, ids, weights, self.w13, self.w2, self.w13_scale_inv,
                                           self.w2_scale_inv, shared=self.shared_slots, shared_out=shared)
        if moe_kernels.supported(x, ids.numel()):  # decode sizes on CUDA: route + two fused GEMMs
            per_token = moe_kernels.fused_experts(x, ids, self.w13, self.w2)  # [T, K, D]
            return moe_kernels.combine(per_token, weights, shared=shared)
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        # Tokens per expert by scatter-add: bincount would sync with the host (it sizes its output).
        counts = flat.new_zeros(self.w13.shape[0]).index_add_(0, flat, torch.ones_like(flat))  # [E]
        token_idx = order // k
        xs = x[token_idx]  # [T*K, D], grouped by expert
        out = self._experts_grouped(xs, counts) if _use_grouped_mm(xs) else self._experts_loop(xs, counts)
        if moe_kernels.usable(out):  # the weighted sum read through the permutation, and the add, in one pass
            row_of = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
            return moe_kernels.combine(out, weights, row_of=row_of, shared=shared)
        # Back to (token, choice) order (a permutation: no atomics), then each token's weighted sum
        # of its K expert outputs as one batched [1, K] x [K, D] product.
        per_choice = torch.empty_like(out).index_copy_(0, order, out).view(-1, k, out.shape[-1])
        routed = torch.bmm(weights.unsqueeze(1).to(out.dtype), per_choice).squeeze(1)
        return routed + shared if shared is not None else routed

    def _routed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(w13, w2, their scales) of the routed experts alone: the stack less its shared slots (a choice of
        ``routed``, expert parallelism's id for another rank's expert, is then skipped, not a shared slot)."""
        r = self.routed
        s13, s2 = self.w13_scale_inv, self.w2_scale_inv
        return (self.w13[:r], self.w2[:r], s13[:r] if s13 is not None else None,
                s2[:r] if s2 is not None else None)

    def _shared_sums(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' sum on rows x [T, D] (expert parallelism: this rank's own rows), by their MLP or,
        held in block FP8, by their slots of the stack alone; None without shared experts or rows."""
        if self.shared_experts is not None:
            return self.shared_experts(x) if x.shape[0] else None
        if not self.shared_slots or not x.shape[0]:
            return None
        none = x.new_empty(x.shape[0], 0, dtype=torch.long)
        return moe_kernels.experts_sum(x, none, none.float(), self.w13, self.w2, self.w13_scale_inv,
                                       self.w2_scale_inv, shared=self.shared_slots)

    def routed_params(self) -> int:
        """Parameters of the routed experts held here (the shared experts' slots not counted)."""
        return (self.w13.numel() + self.w2.numel()) // self.w13.shape[0] * self.routed

    def _forward_ep(self, x: torch.Tensor, counts: list[int], static: bool = False) -> torch.Tensor:
        """Dispatch every rank's routed rows, run this rank's experts on the choices that picked them, and
        combine the weighted sums back to their rows' owners (``engine.parallel.expert_parallel``). Every
        rank of the group calls this in every MoE layer of a step, rows or none."""
        ep = self.ep
        assert ep is not None and ep.comm is not None
        if x.shape[0] != counts[ep.shard.rank]:
            raise RuntimeError(f"EP rank {ep.shard.rank} has {x.shape[0]} rows, the step's counts say "
                               f"{counts[ep.shard.rank]}")
        weights, ids = self.gate(x)  # [T, K]
        shared = self._shared_sums(x)
        xs_all, ids_all, w_all = ep.comm.dispatch(x, ids, weights, counts)  # padded rows choose nothing real
        if static:
            routed = ep.comm.combine(self._local_sums(xs_all, ids_all, w_all), counts)
            return routed + shared if shared is not None else routed
        k = ids_all.shape[1]
        pos, local = ep.expert_rows(ids_all)
        order = torch.argsort(local, stable=True)
        pos, local = pos[order], local[order]
        per_expert = local.new_zeros(self.routed).index_add_(0, local, torch.ones_like(local))
        rows = pos // k
        xs = xs_all[rows]  # grouped by local expert
        if self.w13_scale_inv is not None:  # block FP8: the fused W8A8 kernels, one choice per gathered row
            out = moe_kernels.fused_experts(xs, local.unsqueeze(1), *self._routed())[:, 0] if len(local) else xs
        elif _use_grouped_mm(xs):
            out = self._experts_grouped(xs, per_expert)
        else:
            out = self._experts_loop(xs, per_expert)
        contrib = out * w_all.flatten()[pos].unsqueeze(1).to(out.dtype)
        partial = xs_all.new_zeros(xs_all.shape).index_add_(0, rows, contrib)
        routed = ep.comm.combine(partial, counts)
        return routed + shared if shared is not None else routed

    def _local_sums(self, xs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Gathered rows xs [N, D] with their top-k ``ids`` and ``weights`` [N, K] -> each row's weighted sum over
        its choices of this rank's experts [N, D], in shapes fixed by N (a CUDA graph's step): every choice
        goes in, those of other ranks' experts skipped (``moe_kernels``: an id past the local experts), where
        the eager path first picks out this rank's choices (their number is read on the host)."""
        assert self.ep is not None
        local, mine = self.ep.local_choices(ids)  # [N, K]
        if moe_kernels.usable(xs):
            per_choice = moe_kernels.fused_experts(xs, local, *self._routed())  # [N, K, D]
        else:  # (CPU: graph steps run eagerly in tests)
            per_choice = self._experts_by_choice(xs, local).view(*local.shape, -1)
        per_choice.masked_fill_(~mine.unsqueeze(-1), 0)  # the skipped choices' slots were never written
        if moe_kernels.usable(per_choice):
            return moe_kernels.combine(per_choice, weights)
        return torch.bmm(weights.unsqueeze(1).to(per_choice.dtype), per_choice).squeeze(1)

    def _experts_by_choice(self, xs: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The torch form of ``_local_sums``' experts: rows xs [N, D], local expert ids [N, K] (``E``: skipped)
        -> [N * K, D] in (row, choice) order, skipped slots unwritten."""
        e, k = self.routed, local.shape[1]
        flat = local.flatten()
        order = torch.argsort(flat, stable=True)  # by expert, the skipped last
        per_expert = flat.new_zeros(e + 1).index_add_(0, flat, torch.ones_like(flat))[:e]
        grouped = xs[order // k]
        out = self._experts_grouped(grouped, per_expert) if _use_grouped_mm(grouped) else \
            self._experts_loop(grouped, per_expert)
        return torch.empty_like(out).index_copy_(0, order, out)

    def _experts_loop(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            seg = xs[start : start + n]
            gate, up = F.linear(seg, self.w13[e]).chunk(2, dim=-1)
            out[start : start + n] = F.linear(F.silu(gate) * up, self.w2[e])
            start += n
        return out

    def _experts_grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """All experts in two grouped GEMMs (no per-expert launches, no host sync)."""
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs)  # [N, 2I]
        if moe_kernels.usable(h):
            act = moe_kernels.silu_mul(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return torch._grouped_mm(act, self.w2.transpose(1, 2), offs=offs)


def _use_grouped_mm(x: torch.Tensor) -> bool:
    """torch's grouped GEMM: bf16 on Hopper (sm90) or newer."""
    return x.is_cuda and x.dtype == torch.bfloat16 and _grouped_mm_supported(x.device.index or 0)


@functools.cache
def _grouped_mm_supported(device_index: int) -> bool:
    # Asked once per device: this runs in every MoE layer of every (host-bound) decode step.
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device_index)[0] >= 9
