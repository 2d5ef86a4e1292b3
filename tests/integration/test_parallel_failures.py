"""A parallel LLM whose rank dies or fails reports it and stops every other rank within 10 s."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from procs import wait_until
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.parallel.rank_group import RankFailure

KW = dict(dtype="float32", device="cpu", max_model_len=1024)
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(607)], [5, 9, 17, 33, 65, 129, 257]]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


PP2_PCP2 = dict(pcp=2, pp=2)


EP_PP2_PCP2 = {**PP2_PCP2, "enable_expert_parallel": True}
EP_DP2 = dict(dp=2, enable_expert_parallel=True)


@pytest.mark.parametrize("victim,topo", [(1, PP2_PCP2), (3, PP2_PCP2), (3, EP_PP2_PCP2), (1, EP_DP2)],
                         ids=["stage0-pcp1", "stage1-pcp1", "stage1-pcp1-expert-parallel",
                              "dp2-replica1-expert-parallel"])
def test_killed_rank_mid_generation_fails_the_node_within_10s(tiny_model, victim, topo) -> None:
    """With expert parallelism the survivors also wait in MoE collectives: they fail as fast; across DP
    replicas (lockstep), the other replica's ranks too."""
    llm = LLM(str(tiny_model), **KW, **topo)
    pids = llm.node.pids()
    assert len(pids) == topo.get("dp", 1) * topo.get("pcp", 1) * topo.get("pp", 1)
    failure: list[tuple[float, BaseException]] = []

    def generate() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            failure.append((time.monotonic(), e))

    t = threading.Thread(target=generate)
    t.start()

    def decoding() -> bool:  # every prompt prefilled and a decode step done: inside the decode loop
        running = [s for e in llm.engines for s in e.scheduler.running]
        return len(running) == len(PROMPTS) and all(len(s.output_token_ids) >= 2 for s in running)

    wait_until(lambda: decoding() or not t.is_alive(), 30, "generation to reach the decode loop")
    assert t.is_alive(), "generation ended before the rank could be killed"
    os.kill(pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    t.join(30)
    assert not t.is_alive()
    assert failure, "generation did not fail"
    when, err = failure[0]
    assert isinstance(err, RankFailure)
    assert f"rank {victim}" in str(err)
    assert when - killed_at < 10
    wait_until(lambda: _gone(pids), killed_at + 10 - time.monotonic(), "the other ranks to stop, 10 s from the crash")
    assert [e.num_used_blocks for e in llm.engines] == [0] * len(llm.engines)  # failed requests aborted on the driver
    with pytest.raises(RankFailure):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    llm.shutdown()


def test_a_rank_error_at_startup_is_reported_with_its_cause(tiny_model, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny_model / "model.safetensors"))
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]  # a last-stage weight: only rank 1 loads it
    save_file(tensors, str(broken / "model.safetensors"))
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="model.layers.2.self_attn.kv_b_proj.weight"):
        LLM(str(broken), **KW, pp=2)
    assert time.monotonic() - t0 < 60


def test_an_interrupted_step_stops_the_node(tiny_model) -> None:
    llm = LLM(str(tiny_model), **KW, pcp=2)
    ex = llm.engine.executor
    real_collect = ex.collect

    def interrupted() -> None:
        raise KeyboardInterrupt

    ex.collect = interrupted  # the step is on the ranks; the driver is interrupted before its answer
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(max_tokens=4))
    ex.collect = real_collect
    assert llm.engine.num_used_blocks == 0
    with pytest.raises(RankFailure, match="interrupted"):  # never reads the stale answer as a new step's
        llm.generate(PROMPTS, SamplingParams(max_tokens=4))
    llm.shutdown()


def test_sharded_cache_too_small_for_the_busiest_rank_is_refused(tiny_model) -> None:
    # 80 tokens = 5 blocks in runs of 4 (interleave 64): rank 0 must hold 4 of them.
    with pytest.raises(ValueError, match=r"\(4 blocks on a rank\)"):
        LLM(str(tiny_model), **{**KW, "max_model_len": 80}, pcp=2, kv_interleave=64, num_kv_blocks=3)
