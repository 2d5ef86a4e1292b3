"""Expert parallelism over a PP stage's DP x PCP ranks (``enable_expert_parallel``, EP = DP x PCP): each rank
loads only its 1/EP of the routed experts, and every MoE layer dispatches its tokens over the group and
combines them back (gloo). Greedy tokens and logprobs equal the same topology with EP off, in PCP2 (sharded
and replicated KV), PP2 x PCP2 (EP2 per stage), DP2 (EP2) and DP2 x PCP2 (EP4, sharded and replicated),
with chunked prefill, prefix-cache hits, decode rows beside prefill rows, a rank with no rows in a step,
and (DP) a replica with no requests for many steps while the other works, and requests arriving at one
replica in the middle of the other's; experts that do not divide are refused with their reason."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from topology_runs import EP_PARAMS, EP_PROMPTS, EP_SHARED, TOPOLOGIES, Run, run_topology

from engine import LLM, SamplingParams

KW = dict(dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=128)
EP_TOPOLOGIES = ["pcp2-sharded", "pcp2-replicated", "pp2-pcp2", "dp2", "dp2-pcp2-sharded", "dp2-pcp2-replicated"]


def ep_size(topo: dict) -> int:
    return int(topo.get("dp", 1)) * int(topo["pcp"] if "pcp" in topo else 1)


@pytest.mark.parametrize("topo", EP_TOPOLOGIES)
def test_expert_parallel_equals_ep_off(tiny_model: Path, topology_runs: Callable[[str], Run], topo: str) -> None:
    """Both starts run ``topology_runs.py``'s three parts (EP off's shared with test_pcp_topologies.py): EP's
    prompts and DP sections above, after the PCP modules' prompts (prompt logprobs, prefix-cache hits)."""
    off = topology_runs(topo)
    on = run_topology(tiny_model, topo, enable_expert_parallel=True)
    for (w_ids, w_lp), (g_ids, g_lp) in zip(off.ep, on.ep, strict=True):
        assert g_ids == w_ids and len(g_ids) == EP_PARAMS.max_tokens
        # The same products, summed in another order (per choice, then over the group): fp32 rounding.
        assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(g_lp, w_lp, strict=True))
    for want, got in zip([off.outputs, *off.cached], [on.outputs, *on.cached], strict=True):
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids
            assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(g.logprobs, w.logprobs, strict=True))
            assert all((x is None and y is None) or math.isclose(x, y, abs_tol=1e-5)
                       for x, y in zip(g.prompt_logprobs or [], w.prompt_logprobs or [], strict=True))
    for r in (off, on):
        assert r.ep_hit_blocks >= len(EP_SHARED) // 16  # the last prompt hit the cache
        assert r.ep_used_blocks == [0] * len(r.ep_used_blocks)
    ep = ep_size(TOPOLOGIES[topo])
    assert len(off.ep) == len(EP_PROMPTS) + (2 if "dp" in TOPOLOGIES[topo] else 0)
    assert off.expert_params and all(n == off.expert_params[0] for n in off.expert_params)  # EP off: all experts
    assert on.expert_params == [n // ep for n in off.expert_params]  # EP on: 1/EP of them, from its loaded modules


def test_indivisible_experts_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    from pdctl.tiny_model import make_tiny_model

    odd = make_tiny_model(tmp_path / "odd", arch="v2", moe=True, seed=1)
    import json

    cfg = json.loads((odd / "config.json").read_text())
    n = cfg["n_routed_experts"]
    with pytest.raises(ValueError, match=f"{n} routed experts do not divide over 3 EP ranks"):
        LLM(str(odd), **KW, pcp=3, enable_expert_parallel=True)


def test_each_rank_loads_only_its_experts_from_either_checkpoint_layout(tiny_model: Path, tmp_path: Path) -> None:
    """Per-expert tensors (the Hub's) and transformers-5's fused ones give an EP rank the same slice."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.config import ModelConfig
    from engine.parallel.expert_parallel import ExpertShard
    from engine.weights import build_empty_model, load_weights

    fused = tmp_path / "fused"
    shutil.copytree(tiny_model, fused)
    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    mc = ModelConfig.from_pretrained(tiny_model)
    out = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    for layer in {int(n.split(".")[2]) for n in tensors if ".mlp.experts." in n}:
        e = f"model.layers.{layer}.mlp.experts"
        out[f"{e}.gate_up_proj"] = torch.stack([torch.cat((tensors[f"{e}.{j}.gate_proj.weight"],
                                                           tensors[f"{e}.{j}.up_proj.weight"]))
                                                for j in range(mc.n_routed_experts)])
        out[f"{e}.down_proj"] = torch.stack([tensors[f"{e}.{j}.down_proj.weight"] for j in range(mc.n_routed_experts)])
    (fused / "model.safetensors").unlink()
    save_file(out, str(fused / "model.safetensors"), metadata={"format": "pt"})

    def params(model_dir: Path, shard: ExpertShard | None) -> dict[str, torch.Tensor]:
        model = build_empty_model(mc, torch.float32, torch.device("cpu"), experts=shard)
        load_weights(model, model_dir)
        return dict(model.named_parameters())

    full = params(tiny_model, None)
    shard = ExpertShard(1, 2, mc.n_routed_experts)
    for layout in (tiny_model, fused):
        mine = params(layout, shard)
        for name, p in mine.items():
            want = full[name][shard.start : shard.stop] if name.endswith((".w13", ".w2")) else full[name]
            assert torch.equal(p, want), (layout.name, name)


def test_a_prefill_node_with_ep_across_its_dp_replicas_serves_either_replica(tiny_model: Path) -> None:
    """A prefill node process with DP2 and EP2: its engine loop steps both replicas in lockstep, so a prefill
    sent to either one (the other idle) gives EP off's first token, and the node publishes EP2."""
    import os
    import signal
    import subprocess
    import sys

    from mux_calls import mux_prefill
    from procs import wait_registered

    from cluster.config import RegistryConfig
    from cluster.proto_gen import pdcluster_v1_pb2 as pb
    from cluster.registry import Registry
    from pdctl.redis_server import start_redis

    prompts = EP_PROMPTS[:2]
    with LLM(str(tiny_model), **KW) as llm:
        want = [o.token_ids[0] for o in llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))]
    redis = start_redis()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefill_node", "--model", str(tiny_model), "--node-id", "p-ep", "--registry-url",
         redis.url, "--cluster", "ep", "--dtype", "float32", "--device", "cpu", "--max-model-len", "1024",
         "--max-num-batched-tokens", "128", "--num-kv-blocks", "64", "--dp", "2", "--enable-expert-parallel"],
        start_new_session=True)
    registry = Registry(RegistryConfig(url=redis.url, cluster="ep"))
    try:
        node = wait_registered(proc, registry)
        assert (node.info.dp, node.info.ep) == (2, 2)
        for replica in (1, 0, 1):
            for i, prompt in enumerate(prompts):
                req = pb.PrefillRequest(request_id=f"r{replica}-{i}-{len(prompt)}", token_ids=prompt, dp_rank=replica,
                                        sampling=pb.SamplingParams(temperature=0, max_tokens=1))
                resp = mux_prefill(node.info.address, req)
                assert (resp.dp_rank, resp.first_token.token_id) == (replica, want[i])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
        registry.close()
        redis.stop()

