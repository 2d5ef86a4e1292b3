"""PCP and PP on GPUs (NCCL, one rank per GPU): the same results as one GPU. Needs 2 GPUs."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(607)], [5, 9, 17, 33, 65, 129, 257]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, prompt_logprobs=1)
GPU = dict(device="cuda", max_model_len=1024, num_kv_blocks=256)


@pytest.mark.parametrize("topo", [dict(pcp=2), dict(pp=2), dict(pcp=2, kv_layout="replicated")],
                         ids=["pcp2", "pp2", "pcp2-replicated"])
def test_fp32_topology_matches_one_gpu(tiny_model, topo) -> None:
    with LLM(str(tiny_model), dtype="float32", **GPU) as one:
        ref = one.generate(PROMPTS, PARAMS)
    with LLM(str(tiny_model), dtype="float32", **GPU, **topo, max_num_batched_tokens=128) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        assert llm.engine.num_used_blocks == 0
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(o.logprobs, r.logprobs))
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]))


def test_bf16_pcp2_flash_path_matches_fp32_cpu(tiny_model) -> None:
    prompts = [p for p in PROMPTS]
    with LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=1024) as cpu:
        ref = cpu.prompt_logits(prompts)
    for budget in (2048, 64):
        with LLM(str(tiny_model), dtype="bfloat16", **GPU, pcp=2, max_num_batched_tokens=budget) as llm:
            got = llm.prompt_logits(prompts)
        for g, r in zip(got, ref):
            assert float((g - r).norm() / r.norm()) < 2e-2


@pytest.mark.parametrize("kv", ["fp8", "fp8_ds_mla"])
def test_fp8_kv_through_a_pcp2_prefill_and_a_transfer_is_one_gpus(tiny_model, kv: str) -> None:
    """An FP8 cache's rows from a PCP2 prefill (one rank per GPU) arrive on a decode engine through Mooncake
    byte for byte, and equal the rows one GPU computes for the same prompt: layer 0's (which depend on the
    prompt alone) exactly; later layers' but for the few roundings to e4m3 that the ranks' other summation
    order flips (one e4m3 step each; 0.26% of layer 2's in fp8_ds_mla on CPU, where flips compound)."""
    from engine_helpers import add_prefilled, fill_from, read_kv

    from kv_transfer.handoff import KVReceiver
    from kv_transfer.layout import RequestKV
    from kv_transfer.transport import register_cache

    try:
        from kv_transfer.transports.mooncake import MooncakeExporter, MooncakeTransport

        transport = MooncakeTransport()
    except (ImportError, RuntimeError, OSError) as e:
        pytest.skip(f"Mooncake is not usable here: {e}")
    prompt, one = PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0)
    # The same chunks on both sides: a chunk attends earlier chunks through the FP8 cache, itself unquantized.
    kw = dict(GPU, dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=128)
    with LLM(str(tiny_model), **kw) as single:
        se = single.engine
        se.add_request(prompt, one, request_id="r", hold_kv=True)
        while se.has_unfinished():
            se.step()
        alone = read_kv(se, "r")
    with (
        LLM(str(tiny_model), **kw, pcp=2, cache_exporter=MooncakeExporter()) as prefill,
        LLM(str(tiny_model), **kw) as decode,
    ):
        pe, de = prefill.engine, decode.engine
        seq = pe.add_request(prompt, one, request_id="r", hold_kv=True)
        while pe.has_unfinished():
            pe.step()
        receiver = KVReceiver(transport, register_cache(transport, de.executor.cache.layers), timeout_s=30)
        request = RequestKV(pe.kv_ownership("r"), len(pe.held["r"].block_ids))
        fill = fill_from(receiver, "r", request, prefill.cache_exports)
        more = SamplingParams(max_tokens=4, temperature=0.0)  # still running after its first token: readable
        add_prefilled(de, prompt, seq.output_token_ids[0], more, fill, request_id="r")
        assert receiver.stats.recent[-1].ok and receiver.stats.recent[-1].sources == 2
        sent, got = read_kv(pe, "r"), read_kv(de, "r")
        assert pe.release("r")
        while de.has_unfinished():
            de.step()
        assert pe.num_used_blocks == 0 and de.num_used_blocks == 0
        transport.close()
    assert sorted(sent) == sorted(got) == sorted(alone)
    for layer in sent:
        assert torch.equal(sent[layer], got[layer]), f"layer {layer} changed in the transfer"
    assert torch.equal(got[0], alone[0]), "layer 0's rows differ from one GPU's"
    for layer in list(got)[1:]:
        d, ref = (got[layer] - alone[layer]).abs(), alone[layer].abs()
        # A flip is a rounding that went the other way; fp8_ds_mla's group scales (amax / 448) also move by
        # float32 ulps, which moves a whole group's values by as little.
        flips = d > 1e-4 * ref + 1e-6
        assert flips.float().mean() < 1e-2, f"layer {layer}: {int(flips.sum())} values rounded otherwise"
        assert bool((d <= ref / 4 + 4e-3).all()), f"layer {layer}: a value moved by more than one e4m3 step"
