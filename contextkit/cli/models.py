"""``contextkit models list|prepare`` and ``contextkit calibrate``: the models the built-in engine runs, and
the per-model calibration profile that resolves ``ReuseOptions(policy="budget")``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from contextkit.cli.common import CacheOpt, ModelOpt, _fail, _need_local, _status, app, err, out, parse_sets
from contextkit.core.config import DEFAULT_CACHE_DIR, ContextKitConfig
from contextkit.core.errors import ContextKitError

models_app = typer.Typer(no_args_is_help=True, help="Prepare and list models.")


@models_app.command("list")
def models_list(cache_dir: CacheOpt = DEFAULT_CACHE_DIR) -> None:
    """Packaged models and the ones already prepared."""
    from rich.table import Table

    from contextkit.core.models import ALIASES, REGISTRY, list_prepared

    prepared = {m["name"]: m["path"] for m in list_prepared(cache_dir)}
    table = Table(title="models")
    for col in ("name", "aliases", "package", "prepared at", "calibrated", "description"):
        table.add_column(col)
    for name, src in REGISTRY.items():
        aliases = ", ".join(a for a, t in ALIASES.items() if t == name)
        path = prepared.pop(name, "-")
        table.add_row(name, aliases, src.packages, path, _calibrated(path), src.description)
    for name, path in prepared.items():
        table.add_row(name, "", "(own GGUF)", path, _calibrated(path), "")
    out.print(table)


def _calibrated(model_dir: str) -> str:
    """The dtypes a calibration profile beside the model was made for (``contextkit calibrate``)."""
    found = sorted(p.stem.removeprefix("contextkit-calibration-")
                   for p in Path(model_dir).glob("contextkit-calibration-*.json")) \
        if model_dir != "-" else []
    return ", ".join(found) or "-"


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="Packaged model name (see `models list`).")] = "smollm2-135m-instruct",
    gguf: Annotated[Optional[Path], typer.Option(help="Prepare your own GGUF file under NAME instead.")] = None,
    cache_dir: CacheOpt = DEFAULT_CACHE_DIR,
) -> None:
    """Dequantize a packaged GGUF once into a local Hugging Face directory (engine, transformers, vLLM)."""
    _need_local("models prepare")
    from contextkit.core.models import prepare

    status, update = _status(err)
    try:
        with status:
            path = prepare(name, cache_dir, gguf=gguf, progress=update)
    except ContextKitError as exc:
        _fail(str(exc))
    out.print(str(path), highlight=False, soft_wrap=True)


@app.command()
def calibrate(
    model: ModelOpt = "smollm2-135m-instruct",
    data: Annotated[
        Optional[Path], typer.Option(help="QA JSONL in the shape of multihop_dev.jsonl (default: the shared dev "
                                          "file's tune half).")
    ] = None,
    n: Annotated[
        int, typer.Option(help="Questions per length band (more: a tighter bound on each setting; at least 9 at the "
                               "default quantile 0.9).")
    ] = 24,
    dtype: Annotated[str, typer.Option(help="The engine dtype to calibrate: auto, float32 or bfloat16.")] = "auto",
    cache_dir: CacheOpt = DEFAULT_CACHE_DIR,
    out_path: Annotated[
        Optional[Path], typer.Option("--out", help="Write the profile here (default: beside the model).")
    ] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the measured table here.")] = None,
    threads: Optional[int] = None,
    seed: int = 0,
    option: Annotated[
        list[str], typer.Option("--set",
                                help="bands=, ratios=, probe_layers=, quantile=, answer_tokens=, split=, "
                                     "speeds_from=PROFILE (re-time a profile here) (see "
                                     "contextkit.bench.calibrate).")
    ] = [],
) -> None:
    """Measure each recompute setting's answer KL per length band and write the model's calibration profile."""
    _need_local("calibrate")
    from contextkit.bench.harness import BenchContext, run_bench

    extra = parse_sets(option, out=out_path)
    try:
        ctx = BenchContext(name="calibrate", data=data, n=n, seed=seed, json_out=json_out, plot=None,
                           config=ContextKitConfig(model=model, cache_dir=cache_dir, threads=threads, dtype=dtype),
                           options=extra)
        result = run_bench(ctx, console=out)
    except ContextKitError as exc:
        _fail(str(exc))
    err.print(f"profile written to {result.config['profile']}", highlight=False, soft_wrap=True)
