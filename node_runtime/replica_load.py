"""An engine's load as a node publishes it: ``LLMEngine.load()`` into the registry's ``ReplicaLoad``.

The engine may not import ``cluster`` (it is below it), and ``cluster`` must not import the engine's
torch modules (the proxy reads ``cluster.nodes``): the conversion lives with the nodes.
"""

from __future__ import annotations

from cluster.nodes import ReplicaLoad
from engine.llm_engine import EngineLoad


def replica_load(dp_rank: int, load: EngineLoad) -> ReplicaLoad:
    spec = {} if load.spec is None else {"spec_drafts": load.spec.steps, "spec_draft_tokens": load.spec.draft_tokens,
                                         "spec_accepted_tokens": load.spec.accepted_tokens}
    return ReplicaLoad(dp_rank=dp_rank, queued_prefill_tokens=load.queued_prefill_tokens, waiting=load.waiting,
                       running=load.running, used_blocks=load.used_blocks, free_blocks=load.free_blocks,
                       cached_blocks=load.cached_blocks, prefix_hit_blocks=load.prefix_hit_blocks,
                       prefix_query_blocks=load.prefix_query_blocks, preemptions=load.preemptions,
                       held=load.held, **spec)
