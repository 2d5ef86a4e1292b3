"""A 607-token prompt prefilled on PCP2 x PP2 rank processes in 128-token chunks (later chunks read their context
back from the cache: gathered from the holders when sharded), its blocks held, then pulled through Mooncake into
a decode engine that decodes on: one start per KV layout, shared by ``test_pcp_kv_layout.py`` (where the held KV
is) and ``test_disaggregated_transfer.py`` (the transfer and the decode), which started the same prefill engine
each (four rank processes: the start is most of either test's time). ``handoff`` records what both check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine_helpers import add_prefilled, fill_from, prefill_held, read_kv, used_blocks_per_rank

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from kv_transfer.handoff import KVReceiver
from kv_transfer.transport import register_cache
from kv_transfer.transports.mooncake import MooncakeExporter, MooncakeTransport

KW: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=1024)
PROMPT = [(i * 7 + 3) % 1000 + 2 for i in range(607)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def held_kv(eng: LLMEngine) -> dict[str, Any]:
    """Where request "r"'s held KV is: the whole of it, each PCP rank's part, and the blocks it uses."""
    pcp = eng.config.pcp
    return {
        "kv": read_kv(eng, "r"),
        "per_rank": [read_kv(eng, "r", pcp=p) for p in range(pcp)],
        "used": eng.num_used_blocks,
        "used_per_rank": used_blocks_per_rank(eng),
        "ownership": eng.kv_ownership("r"),
        "blocks": len(eng.held["r"].block_ids),
    }


def handoff(model: Path, layout: str) -> dict[str, Any]:
    """PROMPT prefilled and held as request "r" (``held_kv``'s keys), pulled into a decode engine ("record": the
    receiver's, "sent" / "got": both sides' KV), released once the decode side has it ("used_after_release"),
    then decoded ("output"; "used_at_end": both sides' used blocks)."""
    with (
        LLM(str(model), **KW, pcp=2, pp=2, kv_layout=layout, cache_exporter=MooncakeExporter(),
            max_num_batched_tokens=128) as prefill,
        LLM(str(model), **KW) as decode,
    ):
        pe, de = prefill.engine, decode.engine
        seq, request = prefill_held(pe, PROMPT)
        out = held_kv(pe)
        transport = MooncakeTransport()
        try:
            receiver = KVReceiver(transport, register_cache(transport, de.executor.cache.layers), timeout_s=30)
            fill = fill_from(receiver, "r", request, prefill.cache_exports)
            dseq = add_prefilled(de, PROMPT, seq.output_token_ids[0], GREEDY, fill, request_id="r")
            out["record"] = receiver.stats.recent[-1]
            out["sent"], out["got"] = read_kv(pe, "r"), read_kv(de, "r")
            out["released"] = pe.release("r")  # the decode side confirmed: the prefill side frees
            out["used_after_release"] = pe.num_used_blocks
            while de.has_unfinished():
                de.step()
            out["output"] = dseq.output_token_ids
            out["used_at_end"] = (pe.num_used_blocks, de.num_used_blocks)
        finally:
            transport.close()
    return out

