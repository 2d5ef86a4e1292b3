"""A prefill node answers the decode side's Release at once, even while its engine is inside a long
step (a long prompt's prefill): the answer must not wait a prefill's time, since the decode side
admits the request only after it. The blocks are freed right after that step."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from cluster.config import NodeConfig
from engine import SamplingParams
from engine.engine_config import EngineConfig
from prefill_node.worker import PrefillJob, PrefillWorker

STEP_S = 2.0  # how long the slowed step takes


def test_release_is_answered_during_a_long_step_and_frees_after_it(tiny_model: Path) -> None:
    engine = EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=64)
    worker = PrefillWorker(NodeConfig(role="prefill", node_id="p", engine=engine, lease_s=30), "127.0.0.1")
    loop = asyncio.new_event_loop()
    try:
        def prefill(rid: str) -> object:
            job = PrefillJob(rid, [(i * 7 + 3) % 1000 + 2 for i in range(100)], SamplingParams(max_tokens=8), -1,
                             loop, loop.create_future())
            worker.submit(job)
            return job.future

        held = loop.run_until_complete(asyncio.wait_for(prefill("held"), 60))
        assert held.kv.num_blocks == 7
        eng = worker.engines[0]
        assert eng.num_used_blocks == 7

        slow = threading.Event()
        launch = eng.launch_step

        def slow_launch() -> int:  # the next step takes STEP_S, as a 32k-token prefill would
            if slow.is_set():
                slow.clear()
                time.sleep(STEP_S)
            return launch()

        eng.launch_step = slow_launch  # type: ignore[method-assign]
        slow.set()
        other = prefill("other")  # the engine goes into the slow step with it
        time.sleep(0.3)
        answers: list[tuple[bool, float]] = []
        t0 = time.monotonic()
        worker.release("held", lambda found: answers.append((found, time.monotonic() - t0)))
        assert answers and answers[0][0] and answers[0][1] < 0.2  # at once, not after the step
        assert not worker.leases.take("held")  # the lease has ended: a second release finds nothing
        loop.run_until_complete(asyncio.wait_for(other, 60))
        deadline = time.monotonic() + 10
        while eng.num_used_blocks != 7 and time.monotonic() < deadline:  # only "other"'s blocks stay held
            time.sleep(0.05)
        assert eng.num_used_blocks == 7 and "held" not in worker.held_on
        worker.abort("other")
        deadline = time.monotonic() + 10
        while eng.num_used_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.num_used_blocks == 0
    finally:
        worker.shutdown()
        loop.close()
