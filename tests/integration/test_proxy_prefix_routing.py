"""Prefix-aware routing: with prefill nodes that cache prefixes, the proxy sends a prompt where its
prefix was prefilled before (its own record, ``proxy.routing.prefix_index``), and spreads other prompts."""

from __future__ import annotations

from pathlib import Path

import httpx
from proxy_fakes import FakeDecode, FakeNodes, FakePrefill, Script, node_state, running_proxy

from cluster.config import ProxyConfig
from engine.tokenizer import Tokenizer
from proxy.routing.discovery import StaticNodeSource

SYSTEM = [(i * 7 + 3) % 900 + 2 for i in range(160)]  # 10 full blocks of 16 shared by the prompts below


def test_prompts_sharing_a_prefix_go_where_it_is_cached(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    script = Script(tok.encode("Hello.", add_special_tokens=False), tok.eos_token_id)
    fakes = FakeNodes()
    try:
        p0, p1 = FakePrefill("p0", script), FakePrefill("p1", script)
        source = StaticNodeSource([
            node_state("p0", "prefill", fakes.serve(p0), model="tiny", max_model_len=512, prefix_caching=True),
            node_state("p1", "prefill", fakes.serve(p1), model="tiny", max_model_len=512, prefix_caching=True),
            node_state("d0", "decode", fakes.serve(FakeDecode("d0", script)), model="tiny", max_model_len=512)])
        config = ProxyConfig(model=str(tiny_model), served_model_name="tiny")
        with running_proxy(config, tok, source) as (url, _), httpx.Client(base_url=url, timeout=10) as http:
            def send(prompt: list[int]) -> str:
                before = (len(p0.requests), len(p1.requests))
                r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4})
                assert r.status_code == 200, r.text
                return "p0" if len(p0.requests) > before[0] else "p1"

            first = send(SYSTEM + [5, 6, 7])
            # Same prefix, other endings: all follow the first (both nodes are equally idle otherwise).
            assert {send(SYSTEM + [8 + i] * (i + 1)) for i in range(4)} == {first}
            # Unrelated prompts are spread by load and turn, as without caching.
            others = {send([900 - i] * 40 + [i]) for i in range(4)}
            assert others == {"p0", "p1"}
    finally:
        fakes.stop()
