"""One rank-process start per topology, shared by the modules that check what it gives.

Starting a topology's rank processes (each imports torch and loads the model; four of them take 10-20 s
on 2 cores) costs far more than the prompts it runs, and ``test_pcp_topologies.py`` (chunked prefill and
prefix caching against one process) and ``test_expert_parallel.py`` (EP on against EP off) ran the same
configuration: the same model, a 128-token budget and prefix caching on (the default). ``run_topology`` runs both
modules' prompts in one start and records what each checks; the session fixture ``topology_runs`` (conftest.py)
keeps each topology's EP-off run for every test that asks for it.

The three prompt sets share no first block, so none hits the others' cached blocks: each part computes
what it would on its own (the pool holds them all: no eviction). The first part runs on a fresh engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams
from engine.llm import RequestOutput

KW: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=128)
TOPOLOGIES: dict[str, dict[str, Any]] = {
    "pcp2-sharded": dict(pcp=2, kv_layout="sharded"),
    "pcp2-replicated": dict(pcp=2, kv_layout="replicated"),
    "pcp4": dict(pcp=4),
    "pp2": dict(pp=2),
    "pp2-pcp2": dict(pp=2, pcp=2),
    "dp2": dict(dp=2),
    "dp2-pcp2-sharded": dict(dp=2, pcp=2, kv_layout="sharded"),
    "dp2-pcp2-replicated": dict(dp=2, pcp=2, kv_layout="replicated"),
}

# test_pcp_topologies: a 607-token prompt (five chunks next to decodes) and a 7-token one, with prompt and
# output logprobs.
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(607)], [5, 9, 17, 33, 65, 129, 257]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, prompt_logprobs=1)
# test_pcp_topologies: prompts sharing 200 tokens, run twice (the second time every full block hits).
CACHED_SHARED = [(i * 11 + 5) % 1000 + 2 for i in range(200)]
CACHED_PROMPTS = [CACHED_SHARED + [(i * k + 1) % 1000 + 2 for i in range(30 + 9 * k)] for k in range(1, 4)]
CACHED_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
# test_expert_parallel: a long prompt (chunked), a short one (PCP2 gives a rank no rows of it), and two sharing a
# cached prefix.
EP_SHARED = [(i * 13 + 9) % 1000 + 2 for i in range(64)]
EP_PROMPTS = [[(i * 17 + 1) % 1000 + 2 for i in range(300)], [5, 9, 17], EP_SHARED + [7, 8, 9], EP_SHARED + [40, 41]]
EP_PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)


@dataclass
class Run:
    """What one start of a topology gave, part by part, and its engines' state after each part."""

    outputs: list[RequestOutput] = field(default_factory=list)  # PROMPTS, on the fresh engines
    used_blocks: list[int] = field(default_factory=list)  # per DP replica, after PROMPTS
    local_counts: list[list[int]] = field(default_factory=list)  # per replica: its last step's rows per PCP rank
    cached: list[list[RequestOutput]] = field(default_factory=list)  # CACHED_PROMPTS, each of the two times
    cache_on: bool = False  # every replica has a prefix cache
    cache_hits: int = 0  # during the CACHED_PROMPTS part, over the replicas
    cached_blocks: int = 0  # after it
    cached_used_blocks: list[int] = field(default_factory=list)  # per replica, after it
    ep: list[tuple[list[int], list[float]]] = field(default_factory=list)  # EP_PROMPTS: (tokens, logprobs)
    ep_hit_blocks: int = 0  # replica 0's prefix cache hits during the EP_PROMPTS part
    ep_used_blocks: list[int] = field(default_factory=list)  # per replica, after each of its two DP sections
    expert_params: list[int] = field(default_factory=list)  # per rank: the routed experts' parameters it holds


def _hits(llm: LLM) -> int:
    return sum(e.prefix_cache.hits for e in llm.engines if e.prefix_cache is not None)


def run_topology(model: Path, topo: str, **kw: Any) -> Run:
    """Start ``topo`` (with ``kw`` on top, e.g. ``enable_expert_parallel``) once and run the three parts."""
    r = Run()
    with LLM(str(model), **KW, **TOPOLOGIES[topo], **kw) as llm:
        r.outputs = llm.generate(PROMPTS, PARAMS)
        r.used_blocks = [e.num_used_blocks for e in llm.engines]
        r.local_counts = [list(e.executor.local_counts) for e in llm.engines]  # DP: both replicas ran steps

        hits = _hits(llm)
        r.cached = [llm.generate(CACHED_PROMPTS, CACHED_PARAMS) for _ in range(2)]
        r.cache_on = all(e.prefix_cache is not None for e in llm.engines)  # DP replicas each have their own
        r.cache_hits = _hits(llm) - hits
        r.cached_blocks = sum(e.prefix_cache.num_cached for e in llm.engines if e.prefix_cache is not None)
        r.cached_used_blocks = [e.num_used_blocks for e in llm.engines]

        r.ep, r.ep_hit_blocks, r.ep_used_blocks = _ep_part(llm)
        r.expert_params = list(llm.node.expert_params) if llm.node else []
    return r


def _ep_part(llm: LLM) -> tuple[list[tuple[list[int], list[float]]], int, list[int]]:
    hits = llm.engines[0].load().prefix_hit_blocks
    # With DP2 the first call puts one prompt on each replica (the short one finishes long before the
    # chunked one); the next two run on replica 0 alone, the other idle for all their steps.
    outs = llm.generate(EP_PROMPTS[:2], EP_PARAMS)
    outs += llm.generate(EP_PROMPTS[2:3], EP_PARAMS) + llm.generate(EP_PROMPTS[3:], EP_PARAMS)  # the last hits
    hit_blocks = llm.engines[0].load().prefix_hit_blocks - hits
    used = [e.num_used_blocks for e in llm.engines]
    got = [(o.token_ids, o.logprobs) for o in outs]
    if len(llm.engines) > 1:  # a request joining replica 1 while replica 0 is mid-way through its own
        a = llm.engines[0].add_request(EP_PROMPTS[0], EP_PARAMS)
        steps = 0
        while busy := llm.to_step():
            if steps == 3:
                b = llm.engines[1].add_request(EP_PROMPTS[2], EP_PARAMS)
            for e in busy:
                e.launch_step()
            for e in busy:
                e.finish_step()
            steps += 1
        got += [(list(s.output_token_ids), list(s.logprobs)) for s in (a, b)]
        used += [e.num_used_blocks for e in llm.engines]
    return got, hit_blocks, used

