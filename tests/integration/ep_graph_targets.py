"""A decode replica's engine under expert parallelism with its "CUDA graphs" run eagerly on CPU, as a rank
target (module level, so spawned processes can import it): ``tests/integration/test_decode_ep_graphs.py``.

On CPU nothing can be captured, so ``EagerLadder`` keeps ``DecodeGraphs`` whole but for the two CUDA calls:
capturing a size runs its step once (as the warm-up does, the MoE layers' collectives in lockstep with the
other members), and a replay runs the captured step eagerly over the buffers the replay filled. Each member's
cache has the spare block a GPU's has when graphs are on, for the padding rows' writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decode_node.waves import Waves
from engine.config import ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.engine_config import EngineConfig
from engine.executor import LocalExecutor
from engine.kv_cache import KVCache
from engine.layers import MoE
from engine.llm_engine import LLMEngine, resolve_max_model_len
from engine.parallel.expert_parallel import ExpertGroup
from engine.parallel.rank_group import RankContext
from engine.parallel.rank_messages import Stop
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative import SpecCounts


class EagerLadder(DecodeGraphs):
    """``DecodeGraphs`` with each size "captured" by running its step once, and each replay the captured step
    run eagerly (``launched``: the size of each replay, in order). ``fail_at``: this size fails to capture, after
    its warm-up."""

    def __init__(self, *args: object, fail_at: int | None = None, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.fail_at = fail_at
        self.launched: list[int] = []

    def _capture(self, size: int) -> None:
        self._forward(size)  # the warm-up: its collectives ran with the other members'
        if size == self.fail_at:  # the capture itself failed (its collectives recorded, not run)
            raise RuntimeError(f"no graph of {size} rows (on purpose)")

    def _launch(self, size: int) -> None:
        self.launched.append(size)
        self._forward(size)


class LadderExecutor(LocalExecutor):
    """A replica's executor (the model in process, its share of the experts) whose graphs are an ``EagerLadder``
    of the real ladder of sizes (``max_num_seqs``, ``max_cudagraph_capture_size``)."""

    def __init__(self, config: EngineConfig, mc: ModelConfig, max_model_len: int, ep: ExpertGroup,
                 fail_at: int | None) -> None:
        super().__init__(config, mc, max_model_len, ep)
        # The cache again, with the spare block a GPU's has for the padding rows' writes (past the allocator's).
        n = self.cache.num_blocks
        self.cache = self.runner.cache = KVCache(config.kv_format(mc), range(self.cache_layers), n,
                                                 config.block_size, self.device, spare_blocks=1)
        self.allocator = self.cache.allocator
        self.graphs = EagerLadder(self.model, self.cache, n, max_model_len, config.max_num_seqs,
                                  config.max_cudagraph_capture_size, ep, fail_at=fail_at)
        with torch.inference_mode():
            self.graphs.capture_ladder()  # collective: every member captures the same sizes in the same order
        self.runner.graphs = self.graphs


@dataclass(frozen=True)
class Arrival:
    """Request ``rid`` arrives at member ``member`` at engine-loop iteration ``at``."""

    at: int
    member: int
    rid: str
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Script:
    """What every member runs: the engine's settings, the arrivals (every member knows all of them, so each
    joins a wave when any member starts one, as the node's ``Wake`` makes it), and which size of graph fails
    to capture on which member."""

    model: str
    engine: dict[str, object]
    arrivals: list[Arrival]
    fail_at: dict[int, int] = field(default_factory=dict)  # member -> size
    graphs: bool = True  # False: the plain executor (on CPU every step eager)


@dataclass(frozen=True)
class Ran:
    """What a member reports: each of its requests' tokens and logprobs, the steps it ran (all in lockstep),
    the size of each replay, and its graphs' counters."""

    outputs: dict[str, tuple[list[int], list[float]]]
    steps: int
    launched: list[int]
    captured: list[int]
    replays: int
    pad_replays: int
    prefill_replays: int
    overlapped_steps: int
    used_blocks: int
    spec: SpecCounts  # speculative decoding's drafts (zeros without it)
    drafts: dict[str, list[tuple[int, list[int]]]]  # per request, after each step: (its tokens so far, its drafts)
    mtp_experts: int  # the routed experts of the MTP layer this member holds (0: none)


def record_drafts(seqs: dict[str, Sequence], drafts: dict[str, list[tuple[int, list[int]]]]) -> None:
    """After a step, each request's drafts for the next (speculative decoding), with its output's length."""
    for rid, seq in seqs.items():
        if seq.drafts:
            drafts.setdefault(rid, []).append((len(seq.output_token_ids), list(seq.drafts)))


def ep_graph_replica(ctx: RankContext) -> None:
    """Run the ``Script`` (the payload) as member ``ctx.rank`` of a gloo EP group, report ``Ran``, wait for Stop."""
    script: Script = ctx.payload
    config = EngineConfig(model=script.model, enable_expert_parallel=True, **script.engine)  # type: ignore[arg-type]
    mc = ModelConfig.from_pretrained(config.model)
    assert mc.n_routed_experts
    ep = ExpertGroup.join(mc.n_routed_experts)
    max_len = resolve_max_model_len(config, mc)
    ex = (LadderExecutor(config, mc, max_len, ep, script.fail_at.get(ctx.rank)) if script.graphs
          else LocalExecutor(config, mc, max_len, ep))
    engine = LLMEngine(config, executor=ex, ep=ep)
    waves = Waves(ep, lambda wave: None)
    last = max(a.at for a in script.arrivals)
    seqs: dict[str, Sequence] = {}
    drafts: dict[str, list[tuple[int, list[int]]]] = {}
    steps = 0
    it = 0
    while True:
        arriving = [a for a in script.arrivals if a.at == it]
        for a in arriving:
            if a.member == ctx.rank:
                seqs[a.rid] = engine.add_request(a.prompt, a.params, request_id=a.rid)
        if arriving:
            waves.join(waves.wave)  # the Wake of whichever member starts the wave (a no-op if one runs)
        if waves.step_now(engine.has_unfinished()):
            engine.launch_step()
            engine.finish_step()
            steps += 1
            record_drafts(seqs, drafts)
        elif it > last:
            break
        it += 1
    g = ex.graphs
    assert isinstance(g, EagerLadder) == script.graphs
    ladder: tuple[list[int], list[int], int, int, int] = (
        (g.launched, g.sizes, g.replays, g.pad_replays, g.prefill_replays) if isinstance(g, EagerLadder)
        else ([], [], 0, 0, 0))
    mtp = [m.mlp for m in ex.model.mtp.values()] if ex.model.mtp is not None else []
    ctx.conn.send(Ran({rid: (list(s.output_token_ids), list(s.logprobs)) for rid, s in seqs.items()}, steps,
                      *ladder, engine.overlapped_steps, engine.num_used_blocks, engine.spec_counts, drafts,
                      sum(int(m.w13.shape[0]) for m in mtp if isinstance(m, MoE))))
    while not isinstance(ctx.conn.recv(), Stop):
        pass
