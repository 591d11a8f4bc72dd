"""Per-tier store stats as Prometheus metrics: a ``prometheus_client`` collector read at scrape time.

The tiers keep their own thread-safe counters (``TierStats``); the collector turns ``store.stats()``
into metric families when ``/metrics`` is scraped, so nothing is counted twice and no text is written
by hand. Register it in the server's registry: ``registry.register(StoreCollector(store))``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from contextkit.kvstore.base import COUNTERS

PREFIX = "contextkit_kvstore"


class StoreCollector:
    """Exports ``store.stats()`` (``{tier: {counter: value, ...}}``) with a ``tier`` label."""

    def __init__(self, store, prefix: str = PREFIX):
        self.store = store
        self.prefix = prefix

    def describe(self) -> list[Metric]:
        return []  # families are built per scrape; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        stats = self.store.stats()
        for name in COUNTERS:
            fam = CounterMetricFamily(f"{self.prefix}_{name}", f"kvstore {name.replace('_', ' ')}", labels=["tier"])
            for tier, s in stats.items():
                fam.add_metric([tier], s.get(name, 0))
            yield fam
        for name, doc in (("bytes", "bytes stored"), ("entries", "entries stored")):
            fam = GaugeMetricFamily(f"{self.prefix}_{name}", f"kvstore {doc}", labels=["tier"])
            for tier, s in stats.items():
                fam.add_metric([tier], s.get(name, 0))
            yield fam
        for op in ("get", "put"):
            for q in ("p50", "p99"):
                key = f"{op}_ms_{q}"
                rows = [(tier, s[key]) for tier, s in stats.items() if key in s]
                if rows:
                    fam = GaugeMetricFamily(f"{self.prefix}_{op}_latency_ms_{q}", f"kvstore {op} latency {q}",
                                            labels=["tier"])
                    for tier, v in rows:
                        fam.add_metric([tier], v)
                    yield fam
