"""One benchmark harness, one JSON shape: ``{"bench", "config", "rows", "summary"}``.

A benchmark is a function ``run(ctx, progress) -> BenchResult``. The harness gives it a progress bar,
prints its rows as a rich table, writes the JSON and, if asked, a PNG. Naming conventions for row and
summary keys are in docs/benchmarks.md (``*_ms_p50``, ``speedup_vs_<baseline>``, ``kl_p50``, ...).
"""

from __future__ import annotations

import importlib
import json
import platform
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from contextkit.core.config import ContextKitConfig
from contextkit.core.errors import ConfigError, InputError, UpstreamError
from contextkit.core.stats import percentile

# name -> module that defines run(ctx, progress) -> BenchResult (and optionally plot(result, path)).
# Each bench reports how much it actually used in its summary under one of USED (printed after the table).
USED = ("requests", "questions", "prompts", "reps")
BENCHES = {
    "engine": "contextkit.bench.engine",
    "spans": "contextkit.bench.spans",
    "rope": "contextkit.bench.rope",
    "ordering": "contextkit.bench.ordering",
    "reorder": "contextkit.bench.reorder",
    "store": "contextkit.bench.store",
    "proxy": "contextkit.bench.proxy",
    "robustness": "contextkit.bench.robustness",
    "skills": "contextkit.bench.skills",
    "synthesis": "contextkit.bench.synthesis",
    "agent": "contextkit.bench.agent",
    "pipelines": "contextkit.bench.pipelines",
    "connector": "contextkit.bench.connector",
    "trace": "contextkit.bench.trace",
    "skillcache": "contextkit.bench.skillcache",
    "installs": "contextkit.bench.installs",
    "fleet": "contextkit.bench.fleet",
    "calibrate": "contextkit.bench.calibrate",  # also `contextkit calibrate`: writes the model's profile
}


@dataclass(frozen=True, slots=True)
class BenchContext:
    name: str
    data: Path | None
    n: int | None  # None: the bench's own default (a replayed trace: all of it)
    seed: int
    json_out: Path | None
    plot: Path | None
    config: ContextKitConfig
    options: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n is not None and self.n < 1:
            raise ConfigError(f"--n must be >= 1, got {self.n}")

    def count(self, default: int) -> int:
        """``--n``, or the bench's ``default`` when it was not given."""
        return default if self.n is None else self.n

    def option(self, key: str, default: Any, cast: Callable[[str], Any] = str) -> Any:
        """A bench-specific ``--set KEY=VALUE`` option, cast, or ``default``."""
        if key not in self.options:
            return default
        try:
            return cast(self.options[key])
        except ValueError as exc:
            raise ConfigError(f"--set {key}={self.options[key]!r} is invalid: {exc}") from exc


@dataclass
class BenchResult:
    bench: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"bench": self.bench, "config": self.config, "rows": self.rows, "summary": self.summary}


class Tick:
    """Progress callback handed to a bench: ``tick(total=N)`` once, then ``tick("what")`` per step."""

    def __init__(self, progress: Progress | None):
        self._progress = progress
        self._task = progress.add_task("bench", total=None) if progress else None

    def __call__(self, description: str | None = None, total: int | None = None, advance: int = 1) -> None:
        if self._progress is None or self._task is None:
            return
        if total is not None:
            self._progress.update(self._task, total=total)
            return
        self._progress.update(self._task, advance=advance, description=description or "")


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 0) -> list[float]:
    """Milliseconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def timing_stats(prefix: str, ms: Sequence[float]) -> dict[str, float]:
    """``{prefix}_p50``, ``_p90``, ``_p99`` of millisecond samples (prefix ends in ``_ms``)."""
    return {f"{prefix}_p{q}": round(percentile(ms, q), 3) for q in (50, 90, 99)}


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def print_table(result: BenchResult, console: Console) -> None:
    columns: list[str] = []
    for row in result.rows:
        columns += [k for k in row if k not in columns]
    columns = [c for c in columns if any(row.get(c) is not None for row in result.rows)]
    table = Table(title=f"bench {result.bench}")
    for col in columns:
        table.add_column(col, justify="left" if col in ("impl", "dtype", "name", "policy") else "right", no_wrap=True)
    if not console.is_terminal:  # logs and CI: do not squeeze a wide table into 80 columns
        console = Console(file=console.file, width=max(console.width, 300))
    for row in result.rows:
        table.add_row(*(_fmt(row.get(c)) for c in columns))
    console.print(table)
    # long per-item lists (e.g. every erratum task) are for the JSON, not the screen
    console.print({k: v for k, v in result.summary.items() if not (isinstance(v, list) and len(v) > 8)})
    used = [f"{result.summary[k]} {k}" for k in USED if k in result.summary]
    if used:
        console.print(f"bench {result.bench} used {', '.join(used)}", highlight=False)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def run_bench(ctx: BenchContext, console: Console | None = None) -> BenchResult:
    """Run the named benchmark with a progress bar; print, and write JSON / PNG as asked."""
    console = console or Console()
    if ctx.name not in BENCHES:
        raise InputError(f"unknown bench {ctx.name!r}; available: {', '.join(sorted(BENCHES))}")
    if ctx.data is not None and not ctx.data.is_file():
        raise InputError(f"--data {ctx.data} does not exist; pass a JSONL in the shape of multihop_dev.jsonl")
    module = importlib.import_module(BENCHES[ctx.name])
    if ctx.config.threads is not None:
        torch.set_num_threads(ctx.config.threads)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        result: BenchResult = module.run(ctx, Tick(progress))
    result.config.setdefault("environment", environment())
    print_table(result, console)
    if ctx.json_out is not None:
        ctx.json_out.parent.mkdir(parents=True, exist_ok=True)
        ctx.json_out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        console.print(f"wrote {ctx.json_out}")
    if ctx.plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
        except ImportError as exc:
            raise ConfigError("--plot needs matplotlib: pip install 'contextkit[plot]'") from exc
        ctx.plot.parent.mkdir(parents=True, exist_ok=True)
        module.plot(result, ctx.plot)
        console.print(f"wrote {ctx.plot}")
    return result


def post_completion(url: str, body: dict, *, timeout_s: float = 600, api_key: str | None = None) -> tuple[float, dict]:
    """POST ``body`` to ``url``'s /v1/completions (with ``api_key`` as its bearer, if given): (milliseconds to
    the whole answer, its JSON). An error status raises UpstreamError with the start of the body. (urllib,
    not httpx: a bench's timing loop wants nothing between it and the socket, and these calls are one at a
    time.)"""
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            obj = json.load(r)
    except urllib.error.HTTPError as exc:
        raise UpstreamError(f"{url} answered {exc.code}: {exc.read()[:300]!r}") from None
    return (time.perf_counter() - t0) * 1e3, obj
