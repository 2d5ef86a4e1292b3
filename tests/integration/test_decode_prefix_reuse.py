"""Decode-side reuse: a decode engine with prefix caching pulls only the blocks it does not hold.

Multi-turn chat through a PCP2 prefill and a Mooncake pull: the second turn's prompt is the first
turn's prompt, its answer and a new user turn. The decode engine cached the first turn's blocks
(the pulled prompt and the answer it computed), so the second pull brings only the new tail, and
greedy decoding still gives what one colocated engine gives for the whole prompt.
"""

from __future__ import annotations

import pytest
from engine_helpers import add_prefilled, fill_from

from engine import LLM, SamplingParams
from kv_transfer.handoff import KVReceiver
from kv_transfer.layout import RequestKV
from kv_transfer.transport import register_cache
from kv_transfer.transports.mooncake import MooncakeExporter, MooncakeTransport

KW = dict(dtype="float32", device="cpu", max_model_len=1024)
TURN1 = [(i * 7 + 3) % 1000 + 2 for i in range(607)]
USER2 = [(i * 11 + 5) % 1000 + 2 for i in range(100)]


@pytest.mark.parametrize("layout", ["sharded", "replicated"])
def test_second_turn_pulls_only_its_new_blocks_and_decodes_as_colocated(tiny_model, layout) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model), **KW) as colocated:
        first = colocated.generate([TURN1], greedy)[0].token_ids
        turn2 = TURN1 + first + USER2
        want2 = colocated.generate([turn2], greedy)[0].token_ids
    with (
        LLM(str(tiny_model), **KW, pcp=2, kv_layout=layout, cache_exporter=MooncakeExporter(),
            max_num_batched_tokens=128) as prefill,
        LLM(str(tiny_model), **KW, enable_prefix_caching=True) as decode,
    ):
        pe, de = prefill.engine, decode.engine
        transport = MooncakeTransport()
        receiver = KVReceiver(transport, register_cache(transport, de.executor.cache.layers), timeout_s=30)
        outputs, moved, hits = [], [], []
        for rid, prompt in (("t1", TURN1), ("t2", turn2)):
            seq = pe.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=rid, hold_kv=True)
            while pe.has_unfinished():
                pe.step()
            request = RequestKV(pe.kv_ownership(rid), len(pe.held[rid].block_ids))
            fill = fill_from(receiver, rid, request, prefill.cache_exports)
            dseq = add_prefilled(de, prompt, seq.output_token_ids[0], greedy, fill, request_id=rid)
            moved.append(receiver.stats.last(rid).bytes)
            hits.append(dseq.prefix_hit_blocks)
            assert pe.release(rid)
            while de.has_unfinished():
                de.step()
            outputs.append(dseq.output_token_ids)
            if rid == "t1":  # the second turn is the first one's prompt and answer, then a new user turn
                assert outputs[0] == first
        assert outputs[1] == want2
        # The first turn's tokens with KV here (its prompt and all but its last answer token) are
        # 614: 38 full blocks of 16; the second prompt has 715 tokens, 45 blocks, so 7 are pulled.
        assert hits == [0, (len(TURN1) + len(first) - 1) // 16]
        block_bytes = moved[0] // -(-len(TURN1) // 16)
        assert moved[1] == (-(-len(turn2) // 16) - hits[1]) * block_bytes
        assert moved[0] >= 5 * moved[1]
        assert pe.num_used_blocks == 0 and de.num_used_blocks == 0
        assert de.prefix_cache.num_cached > 0
        transport.close()


def test_a_prompt_held_whole_pulls_nothing(tiny_model) -> None:
    """A prompt of whole blocks all cached at the decode side: no bytes move, decoding still runs."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = TURN1[:512]
    with (
        LLM(str(tiny_model), **KW, cache_exporter=MooncakeExporter()) as prefill,
        LLM(str(tiny_model), **KW, enable_prefix_caching=True) as decode,
    ):
        pe, de = prefill.engine, decode.engine
        transport = MooncakeTransport()
        receiver = KVReceiver(transport, register_cache(transport, de.executor.cache.layers), timeout_s=30)
        outs = []
        for rid in ("a", "b"):
            seq = pe.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=rid, hold_kv=True)
            while pe.has_unfinished():
                pe.step()
            fill = fill_from(receiver, rid, RequestKV(pe.kv_ownership(rid), len(pe.held[rid].block_ids)),
                                 prefill.cache_exports)
            dseq = add_prefilled(de, prompt, seq.output_token_ids[0], greedy, fill, request_id=rid)
            assert pe.release(rid)
            while de.has_unfinished():
                de.step()
            outs.append((dseq.prefix_hit_blocks, dseq.output_token_ids))
        assert outs[0][0] == 0 and outs[1][0] == 32
        assert outs[0][1] == outs[1][1]
        assert receiver.stats.last("b") is None  # nothing was pulled for the second
        assert de.num_used_blocks == 0
        transport.close()
