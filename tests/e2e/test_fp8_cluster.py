"""The deployment the design starts from, through a whole local cluster: a block-FP8 checkpoint (``pdctl
make-model --quantize fp8``) with DeepSeek's FP8 KV rows (``kv_cache_dtype: fp8_ds_mla``) on a DP2 x PCP2
prefill node with sharded KV and expert parallelism over its four ranks (EP4: each holds a quarter of the
routed experts; its replicas step in lockstep), and a DP2 decode node with expert parallelism over its two
replica processes (EP2, lockstep by waves), beside a second decode node whose cache is plain and which holds
every expert. With the openai client, chat and completions, streamed or not, one at a time and several at
once, give the greedy tokens of the dequantized twin on one engine with EP off and the same cache format;
the FP8 rows are what moves; the router never pairs the prefill node with the plain decode node and says
why, and that node refuses the prefill node's handle (INVALID_ARGUMENT) when it is sent one anyway."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from e2e_cluster import ADMIN_KEY, Cluster, running_cluster, wait_all_free
from test_cluster import KW, MODEL, client

from cluster.auth import call_metadata
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from engine import LLM, SamplingParams
from pdctl.topology import Topology

PROMPT = [(i * 7 + 3) % 1000 + 2 for i in range(150)]
KV = "fp8_ds_mla"


@pytest.fixture(scope="module")
def fp8_cluster(fp8_model: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
                cluster_run_dirs: list[Path]) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("fp8")
    topo = Topology.from_dict({
        "model": str(fp8_model[0]), "served_model_name": MODEL, "registry": {"cluster": f"fp8-{run_dir.name}"},
        "proxy": {"port": 0, "admin_key": ADMIN_KEY},
        "prefill": [{"dp": 2, "pcp": 2, "kv_layout": "sharded", "max_model_len": 1024, "num_kv_blocks": 128,
                     "kv_cache_dtype": KV, "enable_expert_parallel": True}],
        # decode-0 runs overlapped steps, as GPU nodes do by default (a CPU's default is off)
        "decode": [{"dp": 2, "max_model_len": 1024, "num_kv_blocks": 128, "kv_cache_dtype": KV,
                    "enable_expert_parallel": True, "async_scheduling": True},
                   {"max_model_len": 1024, "num_kv_blocks": 64}],
    })
    with running_cluster(topo, run_dir, fp8_model[0], cluster_run_dirs) as c:
        yield c


def test_an_fp8_checkpoint_through_the_cluster_equals_its_dequantized_twin(fp8_cluster: Cluster,
                                                                          fp8_model: tuple[Path, Path]) -> None:
    with LLM(str(fp8_model[1]), **KW, kv_cache_dtype=KV) as twin:
        want = twin.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, logprobs=1))[0]
    oa = client(fp8_cluster)
    got = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=1)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 16
    # PCP ranks round a few latents to e4m3 otherwise than one process (tests/integration/test_fp8_kv.py)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-3)
    stream = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want.text
    chat = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                      temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    assert not any(wait_all_free(fp8_cluster).values())


def test_several_requests_at_once_over_both_ep_groups_equal_the_twin(fp8_cluster: Cluster,
                                                                     fp8_model: tuple[Path, Path]) -> None:
    """Concurrent requests spread over both prefill replicas and both decode replicas (each EP group steps
    them together, an idle member running the MoE collectives only) and end with the twin's tokens."""
    prompts = [[(i * k + 5) % 1000 + 2 for i in range(n)] for k, n in ((3, 40), (7, 200), (11, 90), (13, 17))]
    tokens = [12, 5, 9, 16]
    with LLM(str(fp8_model[1]), **KW, kv_cache_dtype=KV) as twin:
        want = twin.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in tokens])
    oa = client(fp8_cluster)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda pm: oa.completions.create(model=MODEL, prompt=pm[0], max_tokens=pm[1],
                                                             temperature=0), zip(prompts, tokens)))
    assert [g.choices[0].text for g in got] == [w.text for w in want]
    assert not any(wait_all_free(fp8_cluster).values())


def test_the_fp8_rows_are_what_moves_and_only_to_a_node_that_holds_them(fp8_cluster: Cluster) -> None:
    nodes = fp8_cluster.nodes()
    assert [nodes[n]["kv_cache_dtype"] for n in ("prefill-0", "decode-0", "decode-1")] == [
        KV, KV, "float32"]
    assert [nodes[n]["ep"] for n in ("prefill-0", "decode-0", "decode-1")] == [4, 2, 1]
    assert [nodes[n]["experts_per_rank"] for n in ("prefill-0", "decode-0", "decode-1")] == [2, 4, 8]
    # what pdctl status shows: on CPU the block-FP8 weights are dequantized at load into the compute dtype
    assert {nodes[n]["weights"] for n in ("prefill-0", "decode-0", "decode-1")} == {"float32, from fp8"}
    plan = fp8_cluster.admin.get("/admin/route", params={"prompt_tokens": len(PROMPT), "max_tokens": 8}).json()
    assert plan["prefill"]["node_id"] == "prefill-0" and plan["decode"]["node_id"] == "decode-0"
    refused = {c["node_id"]: c for c in plan["decode_candidates"]}["decode-1"]
    assert not refused["eligible"] and f"cannot read a native (tcp, {KV} KV) node's KV" in refused["reason"]

    token = (fp8_cluster.run_dir / "cluster-token").read_text().strip()
    meta = call_metadata(token)
    sampling = pb.SamplingParams(temperature=0, max_tokens=8)
    with grpc.insecure_channel(nodes["prefill-0"]["address"]) as ch:
        prefill = pb_grpc.PrefillServiceStub(ch)
        resp = prefill.Prefill(pb.PrefillRequest(request_id="fmt", token_ids=PROMPT, sampling=sampling, dp_rank=-1),
                               timeout=60, metadata=meta)
        assert resp.kv.kv_format == KV
        # The bytes a block moves are the FP8 rows': 16 tokens x 656 bytes, every layer's region alike.
        assert {g.block_bytes for src in resp.kv.sources for g in src.regions} == {16 * 656}
        try:
            with grpc.insecure_channel(nodes["decode-1"]["address"]) as dch:
                events = pb_grpc.DecodeServiceStub(dch).Decode(
                    pb.DecodeRequest(request_id="fmt", prompt_token_ids=PROMPT, sampling=sampling,
                                     first_token=resp.first_token, dp_rank=-1, kv=resp.kv),
                    timeout=60, metadata=meta)
                with pytest.raises(grpc.RpcError) as e:
                    list(events)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"cache format {KV!r} differs from this node's 'float32'" in e.value.details()
        finally:
            assert prefill.Release(pb.ReleaseRequest(request_id="fmt"), timeout=10, metadata=meta).found
    assert not any(wait_all_free(fp8_cluster).values())
