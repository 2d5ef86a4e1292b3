"""A block-FP8 checkpoint (``pdctl make-model --quantize fp8``) through a whole local cluster (redis, a PCP2
prefill node with sharded KV, a decode node on a replica process, the proxy), with the openai client:
chat and completions, streamed or not, give the greedy tokens of the dequantized twin on one engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_cluster import ADMIN_KEY, Cluster, running_cluster, wait_all_free
from test_cluster import KW, MODEL, client

from engine import LLM, SamplingParams
from pdctl.topology import Topology

PROMPT = [(i * 7 + 3) % 1000 + 2 for i in range(150)]


@pytest.fixture(scope="module")
def fp8_cluster(fp8_model: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
                cluster_run_dirs: list[Path]) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("fp8")
    topo = Topology.from_dict({
        "model": str(fp8_model[0]), "served_model_name": MODEL, "registry": {"cluster": f"fp8-{run_dir.name}"},
        "proxy": {"port": 0, "admin_key": ADMIN_KEY},
        "prefill": [{"pcp": 2, "kv_layout": "sharded", "max_model_len": 1024, "num_kv_blocks": 128}],
        "decode": [{"max_model_len": 1024, "num_kv_blocks": 128, "dp_processes": "on"}],
    })
    with running_cluster(topo, run_dir, fp8_model[0], cluster_run_dirs) as c:
        yield c


def test_an_fp8_checkpoint_through_the_cluster_equals_its_dequantized_twin(fp8_cluster: Cluster,
                                                                          fp8_model: tuple[Path, Path]) -> None:
    with LLM(str(fp8_model[1]), **KW) as twin:
        want = twin.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, logprobs=1))[0]
    oa = client(fp8_cluster)
    got = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=1)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 16
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    stream = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want.text
    chat = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                      temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    assert not any(wait_all_free(fp8_cluster).values())
