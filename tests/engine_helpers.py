"""What tests ask of an engine that serving never does: a disaggregated admission in one call, the KV
read back from the ranks that hold it, used blocks per PCP rank, the decode attention's form, an expert
parallel member alone in one process (``Alone``), random block-FP8 experts (``fp8_experts``), an FP8 KV cache
through a PCP2 prefill and a Mooncake transfer against one rank's (``check_fp8_kv_pcp2_transfer``).

Nodes admit a transferred request in two halves (``LLMEngine.begin_prefilled`` and
``admit_prefilled``: the pull runs between them while the engine keeps stepping); ``add_prefilled``
is the same in one call, for tests that pull on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.fp8 import FP8_DTYPE, dequantize_blocks, quantize_blocks
from engine.kv_format import KVFormat
from engine.llm_engine import LLMEngine
from engine.mla import MLAttention
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kv_transfer.handoff import KVReceiver
from kv_transfer.layout import CacheLayout, RequestKV

Fill = Callable[[list[int]], list[int]]  # the request's blocks (those not cached here) -> its block table


def fill_from(receiver: KVReceiver, request_id: str, request: RequestKV, sources: dict[int, CacheLayout],
              limit_s: float | None = None) -> Fill:
    """A ``Fill`` that pulls the request's KV through ``receiver`` (``KVReceiver.pull_into``)."""
    return lambda block_ids: receiver.pull_into(request_id, request, sources, block_ids, limit_s)


def add_prefilled(engine: LLMEngine, prompt: list[int], first_token: int, params: SamplingParams, fill: Fill,
                  request_id: str | None = None, first_logprob: float = float("nan")) -> Sequence:
    """Admit a request whose prompt KV was computed elsewhere, in one call: its blocks are allocated,
    ``fill`` gets those not cached here (logical blocks ``seq.prefix_hit_blocks`` on) and returns their
    table, and the request joins the running batch with ``first_token`` as its first output. If ``fill``
    raises, the blocks are freed and the error propagates."""
    seq = engine.begin_prefilled(prompt, params, request_id)
    try:
        hit = seq.prefix_hit_blocks
        table = seq.block_ids[:hit] + fill(seq.block_ids[hit:])
        engine.admit_prefilled(seq, table, first_token, first_logprob)
    except BaseException:
        engine.abort(seq.request_id)
        raise
    return seq


def read_kv(engine: LLMEngine, request_id: str, pcp: int | None = None) -> dict[int, torch.Tensor]:
    """A request's cached latents per layer, [tokens computed, L+R] in position order, read back from the
    ranks that hold them (``pcp``: only that PCP rank's blocks; positions it does not hold are NaN). It
    copies every block to the driver."""
    seq = engine._lookup(request_id)
    bs = engine.config.block_size
    fmt = engine.config.kv_format(engine.model_config)  # stored rows come back decoded
    dim = engine.model_config.kv_cache_dim
    out: dict[int, torch.Tensor] = {}
    for rb in engine.executor.ownership(seq.block_ids):
        if (pcp is not None and rb.pcp != pcp) or not rb.physical:
            continue
        for layer, stored in engine.executor.read_blocks(rb.pcp, rb.pp, rb.physical).items():
            blocks = fmt.decode(stored)
            empty = torch.full((len(seq.block_ids) * bs, dim), float("nan"), dtype=blocks.dtype)
            dst = out.setdefault(layer, empty)
            for j, blk in zip(rb.logical, blocks):
                dst[j * bs : (j + 1) * bs] = blk
    return {layer: t[: seq.num_computed] for layer, t in sorted(out.items())}


def used_blocks_per_rank(engine: LLMEngine) -> list[int]:
    """Used blocks per PCP rank (sharded layout); one entry otherwise."""
    per_rank = getattr(engine.scheduler.allocator, "used_per_rank", None)
    return per_rank() if per_rank is not None else [engine.num_used_blocks]


@dataclass(frozen=True)
class RoundTrip(KVFormat):
    """An ``auto`` cache that holds each latent as ``of`` would give it back: what an FP8 cache's readers
    see, computed the plain way (the oracle of the quantized formats' own paths)."""

    of: KVFormat | None = None

    def encode(self, latent: torch.Tensor) -> torch.Tensor:
        assert self.of is not None
        return self.of.decode(self.of.encode(latent))


def round_trip_kv(model: torch.nn.Module, of: KVFormat) -> None:
    """Make an in-process ``auto`` model store every latent as a cache of format ``of`` returns it."""
    for layer in model.model.layers.values():
        attn = layer.self_attn
        assert isinstance(attn, MLAttention) and not attn.kv_format.quantized
        attn.kv_format = RoundTrip("auto", of.lora, of.rope, of.dtype, of=of)


def set_decode_form(model: torch.nn.Module, form: str) -> None:
    """'absorbed' (what serving runs) or 'decompressed' attention for decode rows: the tests check the
    absorbed math against the prefill path this way. Decode CUDA graphs replay only the absorbed form."""
    if form not in ("absorbed", "decompressed"):
        raise ValueError(f"decode form must be 'absorbed' or 'decompressed', got {form!r}")
    model.decode_form = form
    for layer in model.model.layers.values():
        attn = layer.self_attn
        assert isinstance(attn, MLAttention)
        attn.decode_form = form


def abort_in_flight_and_finish(engine: LLMEngine, seqs: list[Sequence], max_tokens: int) -> None:
    """Abort ``seqs[0]`` while a step is in flight (overlapped, or launched ahead): its blocks stay taken (deferred)
    until that step has run, then are free; the others run to ``max_tokens`` and every block is free at the end."""
    free = engine.scheduler.allocator.num_free
    held = len(seqs[0].block_ids)
    assert engine.abort(seqs[0].request_id)
    assert engine.scheduler.allocator.num_free == free  # the step in flight may still write them
    assert engine.scheduler.num_deferred == held
    engine.step()
    assert engine.scheduler.num_deferred == 0
    while engine.has_unfinished():
        engine.step()
    assert engine.num_used_blocks == 0 and seqs[0].finish_reason == "abort"
    assert all(len(q.output_token_ids) == max_tokens for q in seqs[1:])


class Alone:
    """An EP group's comm (``engine.parallel.expert_parallel.ExpertComm``) as one member with every row sees it:
    dispatch and combine are the identity, so one process runs a member's share of a layer (the other
    members' experts' choices are skipped, their partial sums absent)."""

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x, ids, weights

    def combine(self, out: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return out


def fp8_experts(e: int, d: int, i: int, g: torch.Generator, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """Random experts on ``device`` (``g``'s) in the checkpoint's FP8 form, stacked as the engine holds them
    (w13q, w13s, w2q, w2s), and dequantized in bf16 (w13d, w2d)."""
    w13q = torch.empty(e, 2 * i, d, dtype=FP8_DTYPE, device=device)
    w13s = torch.empty(e, 2 * -(-i // 128), -(-d // 128), device=device)
    w2q = torch.empty(e, d, i, dtype=FP8_DTYPE, device=device)
    w2s = torch.empty(e, -(-d // 128), -(-i // 128), device=device)
    w13d = torch.empty(e, 2 * i, d, dtype=torch.bfloat16, device=device)
    w2d = torch.empty(e, d, i, dtype=torch.bfloat16, device=device)
    for j in range(e):
        for half, (q, s) in enumerate(quantize_blocks(torch.randn(i, d, device=device, generator=g) / d**0.5)
                                      for _ in range(2)):
            w13q[j, half * i:(half + 1) * i] = q
            w13s[j].chunk(2)[half].copy_(s)
            w13d[j, half * i:(half + 1) * i] = dequantize_blocks(q, s, dtype=torch.bfloat16)
        q, s = quantize_blocks(torch.randn(d, i, device=device, generator=g) / i**0.5)
        w2q[j], w2s[j], w2d[j] = q, s, dequantize_blocks(q, s, dtype=torch.bfloat16)
    return w13q, w13s, w2q, w2s, w13d, w2d


def prefill_held(engine: LLMEngine, prompt: list[int], request_id: str = "r") -> tuple[Sequence, RequestKV]:
    """Prefill ``prompt`` (its first token sampled greedily) with its blocks held, as a prefill node does for a
    transfer: the request, and which ranks hold which of its blocks."""
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=request_id,
                             hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    return seq, RequestKV(engine.kv_ownership(request_id), len(engine.held[request_id].block_ids))


def rounding_flips(got: torch.Tensor, want: torch.Tensor, one_step: float = 2e-3) -> torch.Tensor:
    """Where two FP8 caches' decoded rows ``got`` and ``want`` differ by a rounding that went the other way (more
    than fp8_ds_mla's group scales moving by float32 ulps would move a value); AssertionError where one moved by
    more than one e4m3 step (an eighth of the value, or ``one_step``: e4m3's smallest at scale 1.0 is 2^-9)."""
    d, ref = (got - want).abs(), want.abs()
    assert bool((d <= ref / 8 * 1.001 + one_step).all()), "a value moved by more than one e4m3 step"
    return d > 1e-4 * ref + 1e-6


def check_fp8_kv_pcp2_transfer(model: str, kv: str, **kw: object) -> None:
    """An FP8 cache's rows (``kv``: fp8 / fp8_ds_mla) from a PCP2 prefill of engine options ``kw`` arrive on a
    decode engine through Mooncake byte for byte, and equal the rows one rank computes for the same prompt but for
    roundings to e4m3 that another path flips: layer 0's depend on the prompt alone (a GPU's single rank writes
    them through the fused latent kernel, PCP ranks through torch's ops: rare flips; on CPU none); later layers'
    also on the ranks' other summation order, flips there compound (on CPU 3.5e-4 of layer 2's values with fp8,
    2.6e-3 with fp8_ds_mla). Skips where Mooncake is not usable."""
    import pytest

    from engine import LLM
    from kv_transfer.transport import register_cache

    try:
        from kv_transfer.transports.mooncake import MooncakeExporter, MooncakeTransport

        transport, exporter = MooncakeTransport(), MooncakeExporter()
    except (ImportError, RuntimeError, OSError) as e:
        pytest.skip(f"Mooncake is not usable here: {e}")
    prompt = [(i * 7 + 3) % 1000 + 2 for i in range(607)]
    # The same chunks on both sides: a chunk attends earlier chunks through the FP8 cache, itself unquantized.
    kw = dict(kw, kv_cache_dtype=kv, max_num_batched_tokens=128)
    try:
        with LLM(model, **kw) as single:
            prefill_held(single.engine, prompt)
            alone = read_kv(single.engine, "r")
        with LLM(model, **kw, pcp=2, cache_exporter=exporter) as prefill, LLM(model, **kw) as decode:
            pe, de = prefill.engine, decode.engine
            seq, request = prefill_held(pe, prompt)
            receiver = KVReceiver(transport, register_cache(transport, de.executor.cache.layers), timeout_s=30)
            fill = fill_from(receiver, "r", request, prefill.cache_exports)
            more = SamplingParams(max_tokens=4, temperature=0.0)  # still running after its first token: readable
            add_prefilled(de, prompt, seq.output_token_ids[0], more, fill, request_id="r")
            assert receiver.stats.recent[-1].ok and receiver.stats.recent[-1].sources == 2
            sent, got = read_kv(pe, "r"), read_kv(de, "r")
            assert pe.release("r")
            while de.has_unfinished():
                de.step()
            assert pe.num_used_blocks == 0 and de.num_used_blocks == 0
    finally:
        transport.close()
    assert sorted(sent) == sorted(got) == sorted(alone)
    for layer in sent:
        assert torch.equal(sent[layer], got[layer]), f"layer {layer} changed in the transfer"
    for layer in got:
        flips = rounding_flips(got[layer], alone[layer]).float().mean()
        assert flips < (1e-4 if layer == 0 else 1e-2), f"layer {layer}: {float(flips):.1e} of values rounded otherwise"
