"""``ProxyMetrics.add`` / ``observe`` (``cluster.metrics.Tally``): tallied, then flushed, they expose exactly
what direct updates of the series would (counts, sums, bucket bounds, labelled children), once each; the
vLLM-named families mirror the proxy's own."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import ProxyMetrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(registry: CollectorRegistry, prefix: str = "pdcluster_proxy_") -> Samples:
    """Every sample of the families named ``prefix...`` but the creation times, by name and labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples if s.name.startswith(prefix) and not s.name.endswith("_created")}


def _assert_same(got: ProxyMetrics, want: ProxyMetrics) -> None:
    g, w = _samples(got.registry), _samples(want.registry)
    assert g.keys() == w.keys()
    for key, value in w.items():  # a sum: count x amount against count additions
        assert g[key] == pytest.approx(value, rel=1e-12, abs=0), key


@pytest.mark.parametrize("amount", [0.0, 0.0005, 0.001, 0.0010001, 0.05, 1.0, 7.5, 1e6])
@pytest.mark.parametrize("count", [0, 1, 15])
def test_tallied_observations_equal_direct_ones(amount: float, count: int) -> None:
    tallied, direct = ProxyMetrics(), ProxyMetrics()
    tallied.observe(tallied.itl, amount, count=count)
    tallied.observe(tallied.ttft, amount, ("chat",), count=count)
    for _ in range(count):
        direct.itl.observe(amount)
        direct.ttft.labels("chat").observe(amount)
    tallied.flush()
    _assert_same(tallied, direct)


def test_tallied_counts_equal_direct_ones_and_render_flushes_them_once() -> None:
    tallied, direct = ProxyMetrics(), ProxyMetrics()
    for node in ("p0", "p1", "p0"):
        tallied.add(tallied.routing, ("prefill", node))
        direct.routing.labels("prefill", node).inc()
    tallied.add(tallied.prompt_tokens, amount=512)
    tallied.add(tallied.prompt_tokens, amount=7)
    direct.prompt_tokens.inc(519)
    tallied.observe(tallied.e2e, 0.3, ("completions",))
    direct.e2e.labels("completions").observe(0.3)
    tallied.render()  # a page flushes first
    _assert_same(tallied, direct)
    tallied.flush()  # nothing left to add: a second flush changes nothing
    tallied.render()
    _assert_same(tallied, direct)
    page = tallied.render().decode()
    assert 'pdcluster_proxy_routing_decisions_total{node_id="p0",role="prefill"} 2.0' in page
    assert "pdcluster_proxy_prompt_tokens_total 519.0" in page


def test_nothing_reaches_the_series_before_a_flush() -> None:
    m = ProxyMetrics()
    m.add(m.generation_tokens, amount=3)
    m.observe(m.itl, 0.01, count=2)
    assert _samples(m.registry)[("pdcluster_proxy_generation_tokens_total", ())] == 0
    assert _samples(m.registry)[("pdcluster_proxy_inter_token_latency_seconds_count", ())] == 0
    m.flush()
    assert _samples(m.registry)[("pdcluster_proxy_generation_tokens_total", ())] == 3
    assert _samples(m.registry)[("pdcluster_proxy_inter_token_latency_seconds_count", ())] == 2


def test_a_nan_observation_goes_to_the_sum_only_as_a_direct_one() -> None:
    tallied, direct = ProxyMetrics(), ProxyMetrics()
    tallied.observe(tallied.kv_transfer_s, float("nan"))
    tallied.observe(tallied.kv_transfer_s, 0.02)
    direct.kv_transfer_s.observe(float("nan"))
    direct.kv_transfer_s.observe(0.02)
    tallied.flush()
    g, w = _samples(tallied.registry), _samples(direct.registry)
    name = "pdcluster_proxy_kv_transfer_seconds"
    got_sum, want_sum = g.pop((f"{name}_sum", ())), w.pop((f"{name}_sum", ()))
    assert got_sum != got_sum and want_sum != want_sum  # both NaN
    assert g == w  # every bucket and the count: the 0.02 alone
    assert g[(f"{name}_count", ())] == 1


def test_the_vllm_families_mirror_the_proxys_own() -> None:
    m = ProxyMetrics("tiny")
    m.observe(m.ttft, 0.2, ("chat",))
    m.observe(m.ttft, 0.03, ("completions",))
    m.observe(m.itl, 0.004, count=5)
    m.observe(m.e2e, 1.2, ("chat",))
    m.add(m.prompt_tokens, amount=40)
    m.add(m.generation_tokens, amount=6)
    m.flush()
    v = _samples(m.registry, "vllm:")
    labels = (("model_name", "tiny"), ("role", "proxy"))
    assert v[("vllm:time_to_first_token_seconds_count", labels)] == 2
    assert v[("vllm:time_to_first_token_seconds_sum", labels)] == pytest.approx(0.23)
    assert v[("vllm:time_to_first_token_seconds_bucket", (("le", "0.04"), *labels))] == 1
    assert v[("vllm:inter_token_latency_seconds_count", labels)] == 5
    assert v[("vllm:e2e_request_latency_seconds_count", labels)] == 1
    assert v[("vllm:prompt_tokens_total", labels)] == 40
    assert v[("vllm:generation_tokens_total", labels)] == 6
    assert _samples(m.registry)[("pdcluster_proxy_time_to_first_token_seconds_count", (("endpoint", "chat"),))] == 1
