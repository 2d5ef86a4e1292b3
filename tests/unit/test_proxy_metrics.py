"""``observe_many``: k observations at once expose exactly what k calls of ``observe`` would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import observe_many

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """Every sample but the creation time, by name and bucket bound."""
    return {(s.name, s.labels.get("le", "")): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples if not s.name.endswith("_created")}


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("gap_seconds", "a gap", buckets=BUCKETS, registry=registry)


@pytest.mark.parametrize("amount", [0.0, 0.0005, 0.001, 0.0010001, 0.05, 1.0, 7.5])
@pytest.mark.parametrize("count", [0, 1, 15])
def test_observe_many_equals_repeated_observe(amount: float, count: int) -> None:
    one_by_one, h1 = _histogram()
    at_once, h2 = _histogram()
    for _ in range(count):
        h1.observe(amount)
    observe_many(h2, amount, count)
    want, got = _samples(one_by_one), _samples(at_once)
    assert got.keys() == want.keys()
    for key, value in want.items():  # the sum: count x amount against count additions
        assert got[key] == pytest.approx(value, rel=1e-12, abs=0), key


def test_observe_many_on_a_labelled_child() -> None:
    registry = CollectorRegistry()
    h = Histogram("gap_seconds", "a gap", ["endpoint"], buckets=BUCKETS, registry=registry)
    observe_many(h.labels("chat"), 0.02, 3)
    text = generate_latest(registry).decode()
    assert 'gap_seconds_bucket{endpoint="chat",le="0.01"} 0.0' in text
    assert 'gap_seconds_bucket{endpoint="chat",le="0.1"} 3.0' in text
    assert 'gap_seconds_count{endpoint="chat"} 3.0' in text
