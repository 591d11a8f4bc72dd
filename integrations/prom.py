"""A Prometheus histogram in a few lines (the proxy's and the server's TTFT); no client library needed."""

from __future__ import annotations

from collections.abc import Sequence

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds


class Histogram:
    def __init__(self, name: str, buckets: Sequence[float] = TTFT_BUCKETS):
        self.name, self.buckets = name, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: above every bucket
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def lines(self) -> list[str]:
        out, acc = [f"# TYPE {self.name} histogram"], 0
        for b, n in zip(self.buckets, self.counts):
            acc += n
            out.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        total = acc + self.counts[-1]
        return out + [f'{self.name}_bucket{{le="+Inf"}} {total}', f"{self.name}_sum {self.sum:.6f}",
                      f"{self.name}_count {total}"]


class Counter:
    """A counter with labels: ``inc(*values)``; rendered one line per label set, sorted."""

    def __init__(self, name: str, labels: Sequence[str]):
        self.name, self.labels = name, tuple(labels)
        self.values: dict[tuple, int] = {}

    def inc(self, *values, n: int = 1) -> None:
        self.values[values] = self.values.get(values, 0) + n

    def lines(self) -> list[str]:
        out = [f"# TYPE {self.name} counter"]
        for vals, n in sorted(self.values.items(), key=lambda kv: tuple(map(str, kv[0]))):
            labels = ",".join(f'{k}="{v}"' for k, v in zip(self.labels, vals))
            out.append(f"{self.name}{{{labels}}} {n}")
        return out
