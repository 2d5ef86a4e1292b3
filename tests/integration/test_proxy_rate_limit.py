"""``--rate-limit-rps``: a caller past its bucket gets 429 in OpenAI's shape with Retry-After. Without
an API key, callers are told apart by address: varying a header does not escape the limit."""

from __future__ import annotations

from pathlib import Path

import httpx
from proxy_fakes import FakeDecode, FakeNodes, FakePrefill, Script, node_state, running_proxy

from cluster.config import ProxyConfig
from engine.tokenizer import Tokenizer
from proxy.routing.discovery import StaticNodeSource


def test_past_the_burst_a_caller_gets_429_with_retry_after(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    script = Script(tok.encode("Hello.", add_special_tokens=False), tok.eos_token_id)
    fakes = FakeNodes()
    try:
        source = StaticNodeSource([
            node_state("p0", "prefill", fakes.serve(FakePrefill("p0", script)), model="tiny", max_model_len=256),
            node_state("d0", "decode", fakes.serve(FakeDecode("d0", script)), model="tiny", max_model_len=256)])
        config = ProxyConfig(model=str(tiny_model), served_model_name="tiny", rate_limit_rps=0.2, rate_limit_burst=2)
        with running_proxy(config, tok, source) as (url, _):
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 8}
            with httpx.Client(base_url=url, timeout=10) as http:
                assert [http.post("/v1/completions", json=body).status_code for _ in range(2)] == [200, 200]
                r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user",
                                                                                          "content": "x"}]})
                assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "requests"
                assert http.get("/v1/models").status_code == 200  # only generation is limited
                # Without an API key callers are their addresses: another header does not escape the limit.
                other = {"Authorization": "Bearer another-caller"}
                assert http.post("/v1/completions", json=body, headers=other).status_code == 429
                assert 'cause="rate_limited"' in http.get("/metrics").text
    finally:
        fakes.stop()
