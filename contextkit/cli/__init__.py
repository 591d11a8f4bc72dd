"""The ``contextkit`` command: generate and bench (here), models and calibrate (``cli.models``), proxy, connector
and serve (``cli.servers``).

Errors a user can fix (unknown model, corrupt GGUF, prompt too long, empty input) print one line,
``error: <what is wrong>; <how to fix it>``, and exit with code 2. Settings come from flags, with
``CONTEXTKIT_CACHE_DIR`` / ``CONTEXTKIT_MODEL`` read here only (never deeper in the code).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from contextkit.cli.common import CacheOpt, ModelOpt, _fail, _need_local, _status, app, err, out, parse_sets
from contextkit.cli.models import models_app
from contextkit.core.config import DEFAULT_CACHE_DIR, ContextKitConfig
from contextkit.core.errors import ContextKitError, EmptyInputError, InputError

app.add_typer(models_app, name="models")


def _load_request(input_file: Optional[Path], question: Optional[str], documents: list[Path]) -> dict:
    """A request dict {system, documents: [{text, title?, id?}], question} from a JSON file and/or flags."""
    req: dict = {}
    if input_file is not None:
        try:
            text = sys.stdin.read() if str(input_file) == "-" else input_file.read_text()
        except OSError as exc:
            raise InputError(f"cannot read {input_file}: {exc.strerror}; check the path") from exc
        if not text.strip():
            raise EmptyInputError(f"{input_file} is empty; pass a JSON object with a question")
        try:
            req = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{input_file} is not valid JSON ({exc.msg} at line {exc.lineno}); fix the file") from exc
        if not isinstance(req, dict):
            raise InputError(f"{input_file} must hold a JSON object {{system, documents, question}}")
    if question is not None:
        req["question"] = question
    docs = list(req.get("documents") or [])
    for path in documents:
        try:
            docs.append({"title": path.stem, "text": path.read_text()})
        except OSError as exc:
            raise InputError(f"cannot read document {path}: {exc.strerror}; check the path") from exc
    req["documents"] = docs
    return req


@app.command()
def generate(
    question: Annotated[Optional[str], typer.Argument(help="The question (or use --input).")] = None,
    input_file: Annotated[
        Optional[Path], typer.Option("--input", "-i", help="JSON {system, documents, question}; '-' = stdin.")
    ] = None,
    document: Annotated[list[Path], typer.Option("--document", "-d", help="A text file to use as evidence.")] = [],
    system: Annotated[Optional[str], typer.Option(help="System prompt (overrides the JSON's).")] = None,
    model: ModelOpt = "smollm2-135m-instruct",
    cache_dir: CacheOpt = DEFAULT_CACHE_DIR,
    dtype: Annotated[
        str, typer.Option(help="auto (bfloat16 on CPUs with AVX512-BF16/AMX, else float32), float32 or bfloat16.")
    ] = "auto",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: Optional[int] = None,
    stop: Annotated[list[str], typer.Option(help="Stop string (repeatable).")] = [],
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: torch's).")] = None,
    stream: Annotated[bool, typer.Option(help="Print tokens as they come.")] = True,
    stats: Annotated[bool, typer.Option(help="Print timing and token counts to stderr.")] = True,
) -> None:
    """Answer a question over documents on the built-in engine."""
    _need_local("generate")
    from contextkit.core.generation import SamplingParams
    from contextkit.core.types import Evidence
    from contextkit.kit import ContextKit

    try:
        req = _load_request(input_file, question, document)
        if not (req.get("question") or "").strip():
            raise EmptyInputError("no question given; pass one as an argument or in the --input JSON")
        docs = []
        for i, d in enumerate(req["documents"], 1):
            if isinstance(d, str):
                d = {"text": d}
            if not isinstance(d, dict) or not isinstance(d.get("text"), str):
                raise InputError(f"document {i} must be a string or an object with a \"text\" field")
            docs.append(Evidence(text=d["text"], title=d.get("title"), id=d.get("id")))
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=tuple(stop),
        )
        config = ContextKitConfig(model=model, cache_dir=cache_dir, dtype=dtype, threads=threads)
        status, update = _status(err)
        with status:
            update("loading model")
            kit = ContextKit(config, progress=update)
        run = kit.stream(req["question"], docs, system if system is not None else req.get("system"), params)
        for delta in run:
            if stream:
                out.print(delta, end="", highlight=False, markup=False, soft_wrap=True)
        result = run.result
        assert result is not None
        if not stream:
            out.print(result.text, highlight=False, markup=False, soft_wrap=True)
        else:
            out.print()
        if stats:
            err.print(
                f"[dim]{result.prompt_tokens} prompt tokens, {len(result.token_ids)} generated "
                f"({result.finish_reason}); prefill {result.prefill_ms:.0f} ms, "
                f"decode {result.decode_ms_per_token:.1f} ms/token[/]"
            )
    except ContextKitError as exc:
        _fail(str(exc))


@app.command()
def bench(
    name: Annotated[
        str, typer.Argument(help="Benchmark name (engine, spans, rope, ordering, reorder, store, proxy, robustness, "
                                 "skills, synthesis, agent, pipelines, connector, trace, skillcache, installs, fleet).")
    ],
    data: Annotated[Optional[Path], typer.Option(help="JSONL in the shape of multihop_dev.jsonl.")] = None,
    n: Annotated[
        Optional[int], typer.Option(help="Questions / requests / repetitions (default: the bench's own; a --trace "
                                         "replay: all of it).")
    ] = None,
    seed: int = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write results here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Write a PNG plot here.")] = None,
    model: ModelOpt = "smollm2-135m-instruct",
    cache_dir: CacheOpt = DEFAULT_CACHE_DIR,
    threads: Optional[int] = None,
    dtype: Annotated[str, typer.Option(help="Engine dtype of the measured path: auto, float32 or bfloat16.")] = "auto",
    option: Annotated[
        list[str], typer.Option("--set", help="Bench-specific KEY=VALUE (e.g. lengths=512,1024).")
    ] = [],
    upstream: Annotated[
        Optional[str], typer.Option(help="A running vLLM server (ordering, proxy, skillcache); else one is started.")
    ] = None,
    trace: Annotated[
        Optional[Path], typer.Option(help="Replay this request trace (JSONL) instead of generating one.")
    ] = None,
    write_trace: Annotated[Optional[Path], typer.Option(help="Save the generated request stream here.")] = None,
    skills: Annotated[
        Optional[Path], typer.Option(help="A skills folder laid out like ../shared/data/skills (bench skills, "
                                          "skillcache).")
    ] = None,
) -> None:
    """Run a benchmark: prints a table, writes {bench, config, rows, summary} JSON."""
    _need_local("bench")
    from contextkit.bench.harness import BenchContext, run_bench

    extra = parse_sets(option, upstream=upstream, trace=trace, write_trace=write_trace, skills=skills)
    try:
        ctx = BenchContext(
            name=name, data=data, n=n, seed=seed, json_out=json_out, plot=plot,
            config=ContextKitConfig(model=model, cache_dir=cache_dir, threads=threads, dtype=dtype),
            options=extra,
        )
        run_bench(ctx, console=out)
    except ContextKitError as exc:
        _fail(str(exc))


# registered after generate and bench, so `contextkit --help` lists the commands in this order
from contextkit.cli import servers  # noqa: E402,F401  (proxy, connector, serve)


def main() -> None:
    import signal
    import sys

    # SIGTERM unwinds like Ctrl-C, so servers a command started (vLLM, Redis, a proxy) are stopped by its
    # finally blocks instead of being orphaned in their own process groups
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    app()


if __name__ == "__main__":
    main()
