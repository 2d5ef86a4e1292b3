"""Expert parallelism over a replica's PCP ranks (``enable_expert_parallel``, EP = PCP): each rank loads only
its 1/EP of the routed experts, and every MoE layer dispatches its tokens over the group and combines them
back (gloo). Greedy tokens and logprobs equal the same topology with EP off, in PCP2 (sharded and
replicated KV), PP2 x PCP2 (EP2 per stage), with chunked prefill, prefix-cache hits, decode rows beside
prefill rows, and a rank with no rows in a step; EP across DP replicas and experts that do not divide are
refused with their reasons."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

KW = dict(dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=128)
SHARED = [(i * 11 + 5) % 1000 + 2 for i in range(64)]
# A long prompt (chunked), a short one (PCP2 gives a rank no rows of it), and two sharing a cached prefix.
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(300)], [5, 9, 17], SHARED + [7, 8, 9], SHARED + [40, 41]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)
TOPOLOGIES = {
    "pcp2-sharded": dict(pcp=2, kv_layout="sharded"),
    "pcp2-replicated": dict(pcp=2, kv_layout="replicated"),
    "pp2-pcp2": dict(pp=2, pcp=2),
}


def run(model: Path, **kw: object) -> tuple[list, list[int]]:
    with LLM(str(model), **KW, **kw) as llm:
        outs = llm.generate(PROMPTS[:2], PARAMS)
        outs += llm.generate(PROMPTS[2:3], PARAMS) + llm.generate(PROMPTS[3:], PARAMS)  # the last hits the cache
        assert llm.engines[0].load().prefix_hit_blocks >= len(SHARED) // 16
        assert [e.num_used_blocks for e in llm.engines] == [0] * len(llm.engines)
        return outs, list(llm.node.expert_params) if llm.node else []


@pytest.mark.parametrize("topo", list(TOPOLOGIES), ids=list(TOPOLOGIES))
def test_expert_parallel_equals_ep_off(tiny_model: Path, topo: str) -> None:
    want, full = run(tiny_model, **TOPOLOGIES[topo])
    got, held = run(tiny_model, **TOPOLOGIES[topo], enable_expert_parallel=True)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        # The same products, summed in another order (per choice, then over the group): fp32 rounding.
        assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(g.logprobs, w.logprobs))
    ep = TOPOLOGIES[topo]["pcp"]
    assert full and all(n == full[0] for n in full)  # EP off: every rank holds every expert
    assert held == [n // ep for n in full]  # EP on: each rank 1/EP of them, from its loaded modules


def test_ep_across_dp_replicas_and_indivisible_experts_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="across DP replicas"):
        LLM(str(tiny_model), **KW, dp=2, pcp=2, enable_expert_parallel=True)
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
