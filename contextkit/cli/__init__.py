"""The ``contextkit`` command: models and calibrate (``cli.models``), generate, bench, proxy, connector, serve.

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


@app.command()
def proxy(
    upstream: Annotated[list[str], typer.Option(help="A vLLM server URL; repeat for several.")] = [],
    host: Annotated[Optional[str], typer.Option(help="Address to listen on.")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port to listen on.")] = None,
    timeout_s: Annotated[Optional[float], typer.Option(help="Upstream deadline (seconds) before a 504.")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="Upstream KV block size (vLLM: 16 GPU, 32 CPU).")] = None,
    model: Annotated[
        Optional[str], typer.Option(help="Model whose tokenizer renders documents (the upstream's).")
    ] = None,
    config: Annotated[
        Optional[Path], typer.Option(help="JSON file of settings (flags and CONTEXTKIT_PROXY_* env win).")
    ] = None,
    api_keys_file: Annotated[
        Optional[Path], typer.Option(help="JSON {\"<key>\": \"<tenant>\"}: clients authenticate, the tenant comes "
                                          "from the key.")
    ] = None,
    allow_client_tenant: Annotated[
        Optional[bool], typer.Option("--allow-client-tenant",
                                     help="Let a key choose sub-tenants of its own (contextkit.tenant).")
    ] = None,
    upstream_api_key: Annotated[
        Optional[str], typer.Option(envvar="CONTEXTKIT_UPSTREAM_API_KEY",
                                    help="Key sent to the vLLM servers (started with --api-key).")
    ] = None,
    rate_limit: Annotated[
        Optional[str], typer.Option(help="Requests per second per tenant, RATE or RATE/BURST (e.g. 50/100; default: "
                                         "none, as vLLM); 429 past it, before the body is read. 0: no limit.")
    ] = None,
    kv_connector: Annotated[
        Optional[str], typer.Option(help="The KV connector the upstreams run, which documents requests may opt in to: "
                                         "contextkit (span reuse with recompute inside vLLM, contextkit.reuse = {} "
                                         "for the calibrated default), cacheblend (LMCache's, {\"policy\": "
                                         "\"kv_deviation\"}), none.")
    ] = None,
    metrics_key: Annotated[
        Optional[str], typer.Option(envvar="CONTEXTKIT_PROXY_METRICS_KEY",
                                    help="Key (16+ characters) that /metrics takes as Bearer from any address; "
                                         "required for /metrics when clients need keys (without keys /metrics answers "
                                         "loopback only). Prefer the environment variable: a flag shows in ps.")
    ] = None,
    upstream_events: Annotated[
        list[str], typer.Option(help="Where each --upstream publishes its KV events (vLLM's --kv-events-config), same "
                                     "order: tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT], or none.")
    ] = [],
    route_slack: Annotated[
        Optional[int], typer.Option(help="Requests in flight above the least loaded upstream past which an upstream's "
                                         "cache no longer attracts requests (default 4).")
    ] = None,
    session_affinity: Annotated[
        Optional[bool], typer.Option("--session-affinity/--no-session-affinity",
                                     help="A conversation cached nowhere goes to its own upstream (rendezvous hash), "
                                          "not the least loaded (default on).")
    ] = None,
) -> None:
    """OpenAI-compatible proxy in front of vLLM: pass-through, plus cache-aware document ordering and routing."""
    from pydantic import ValidationError

    from contextkit.integrations.proxy import load_settings, serve

    if config is not None and not config.is_file():
        _fail(f"--config {config} does not exist")
    from contextkit.integrations.edge.ratelimit import RateLimit

    rate = None
    if rate_limit is not None:
        try:
            rate = RateLimit.parse(rate_limit)
        except ContextKitError as exc:
            _fail(f"--rate-limit: {exc}")
    flags = {k: v for k, v in dict(upstreams=upstream or None, host=host, port=port, timeout_s=timeout_s,
                                   block_size=block_size, model=model, api_keys_file=api_keys_file,
                                   allow_client_tenant=allow_client_tenant,
                                   upstream_api_key=upstream_api_key, rate_per_s=rate and rate.rate_per_s,
                                   rate_burst=rate and rate.burst, kv_connector=kv_connector,
                                   metrics_key=metrics_key, upstream_events=upstream_events or None,
                                   route_slack=route_slack, session_affinity=session_affinity).items()
             if v is not None}
    try:
        settings = load_settings(config, **flags)
    except (ValidationError, ValueError) as exc:
        errors = exc.errors() if isinstance(exc, ValidationError) else [{"loc": (), "msg": str(exc)}]
        where = ".".join(str(x) for x in errors[0]["loc"]) or "settings"
        hint = (" (pass --upstream URL, or set CONTEXTKIT_PROXY_UPSTREAMS='[\"http://...\"]')"
                if where == "upstreams" else "")
        _fail(f"{where}: {errors[0]['msg']}{hint}")
    try:
        serve(settings)
    except ContextKitError as exc:
        _fail(str(exc))


@app.command()
def connector(
    backend: Annotated[
        str, typer.Option(help="contextkit (our KV connector) or cacheblend (LMCache's CacheBlend, GPU).")
    ] = "contextkit",
    disk_dir: Annotated[Optional[Path], typer.Option(help="contextkit: a disk tier (survives restarts).")] = None,
    remote_url: Annotated[
        Optional[str], typer.Option(help="redis://host:port or lm://host:port, shared by servers.")
    ] = None,
    cache_dir: CacheOpt = DEFAULT_CACHE_DIR,
    ratio: Annotated[float, typer.Option(help="cacheblend: share of reused tokens recomputed.")] = 0.15,
    out: Annotated[Optional[Path], typer.Option(help="cacheblend: where to write LMCache's YAML.")] = None,
) -> None:
    """Print what a stock vLLM server needs to run a KV connector: for contextkit the value of its
    --kv-transfer-config (vllm ... --kv-transfer-config "$(contextkit connector --remote-url ...)"); for
    CacheBlend, LMCache's config file (written to --out), the environment that names it and vLLM's arguments."""
    import json as _json
    import shlex

    if backend == "contextkit":
        from contextkit.integrations.vllm_connector import ConnectorSettings, transfer_config

        try:
            settings = ConnectorSettings(disk_dir=disk_dir, remote_url=remote_url, cache_dir=cache_dir)
        except ContextKitError as exc:
            _fail(str(exc))
        typer.echo(_json.dumps(transfer_config(settings), separators=(",", ":")))
        return
    if backend != "cacheblend":
        _fail(f"--backend must be contextkit or cacheblend, got {backend!r}")
    from contextkit.integrations.vllm_connector.cacheblend import (
        CacheBlendConfig,
        vllm_args,
        vllm_env,
        write_lmcache_config,
    )

    if out is None:
        _fail("--backend cacheblend writes LMCache's config: give --out FILE (e.g. lmcache-blend.yaml)")
    try:
        cfg = CacheBlendConfig(recompute_ratio=ratio, remote_url=remote_url)
        path = write_lmcache_config(cfg, out)
        env = vllm_env(cfg, path)
    except ContextKitError as exc:
        _fail(str(exc))
    for k, v in env.items():
        typer.echo(f"export {k}={shlex.quote(v)}")
    typer.echo(" ".join(shlex.quote(a) for a in vllm_args(cfg)))


@app.command("serve")
def serve_cmd(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    model: ModelOpt = "smollm2-135m-instruct",
    cache_dir: CacheOpt = DEFAULT_CACHE_DIR,
    dtype: Annotated[
        str, typer.Option(help="auto (bfloat16 on CPUs with AVX512-BF16/AMX, else float32), float32 or bfloat16.")
    ] = "auto",
    threads: Optional[int] = None,
    calibration: Annotated[
        Optional[Path], typer.Option(help="The calibration profile that resolves fidelity budgets (default: the one "
                                          "`contextkit calibrate` wrote beside the model).")
    ] = None,
    served_model_name: Annotated[str, typer.Option(help="The model id clients send.")] = "contextkit",
    kv_disk_dir: Annotated[
        Optional[Path], typer.Option(help="LMCache disk tier for span KV (survives restarts).")
    ] = None,
    kv_remote_url: Annotated[
        Optional[str], typer.Option(help="Shared LMCache remote tier: lm://host:port or redis://host:port.")
    ] = None,
    kv_encrypt: Annotated[
        bool, typer.Option("--kv-encrypt",
                           help="Encrypt span KV in the disk and remote tiers (AES-256-GCM, key from the secret).")
    ] = False,
    api_key: Annotated[
        Optional[str], typer.Option(envvar="CONTEXTKIT_API_KEY",
                                    help="One API key (tenant \"default\"); clients send Authorization: Bearer KEY.")
    ] = None,
    api_keys_file: Annotated[
        Optional[Path], typer.Option(help="JSON {\"<key>\": \"<tenant>\"}: the tenant comes from the key.")
    ] = None,
    allow_client_tenant: Annotated[
        bool, typer.Option("--allow-client-tenant", help="Let a key choose sub-tenants of its own (contextkit.tenant).")
    ] = False,
    rate_limit: Annotated[
        str, typer.Option(help="Requests per second per tenant, RATE or RATE/BURST (e.g. 10/20); 429 past it, before "
                               "the body is read. 0: no limit.")
    ] = "10/20",
    metrics_key: Annotated[
        Optional[str], typer.Option(envvar="CONTEXTKIT_METRICS_KEY",
                                    help="Key (16+ characters) that /metrics takes as Bearer; required for /metrics "
                                         "when clients need keys (without keys /metrics answers loopback only). "
                                         "Prefer the environment variable: a flag shows in ps.")
    ] = None,
    compile_idle: Annotated[
        bool, typer.Option("--compile-idle/--no-compile-idle",
                           help="Compile documents requests computed in context into position-free spans while the "
                                "engine is idle (reused at any position later); off: they are reused exactly after "
                                "the same prefix and otherwise from the KV their first request computed.")
    ] = True,
) -> None:
    """OpenAI-compatible server on the built-in engine; chat `documents` are reused as position-free spans."""
    _need_local("serve")
    import dataclasses

    import torch
    import uvicorn

    from contextkit.core.config import KVStoreConfig
    from contextkit.core.tenancy import Tenancy, check_bind, load_api_keys
    from contextkit.integrations.edge.ratelimit import RateLimit
    from contextkit.integrations.serve.app import ServeLimits, create_serve_app
    from contextkit.kit import ContextKit

    try:
        config = ContextKitConfig(model=model, cache_dir=cache_dir, dtype=dtype, threads=threads,
                                  calibration=calibration,
                                  kvstore=KVStoreConfig(disk_dir=kv_disk_dir, remote_url=kv_remote_url,
                                                        encrypt=kv_encrypt))
        keys = load_api_keys(api_keys_file, {api_key: "default"} if api_key else None)
        tenancy = Tenancy(keys, config.load_secret(), allow_client_tenant)
        limits = ServeLimits(rate=RateLimit.parse(rate_limit), compile_idle=compile_idle)
        err.print(check_bind(tenancy, host))
        status, update = _status(err)
        # the model loads on this thread with one torch thread and the engine thread gets them all: a
        # thread that ran an OpenMP parallel region first makes the engine thread's forwards ~20% slower
        engine_threads = config.threads or torch.get_num_threads()
        torch.set_num_threads(1)
        with status:
            update("loading model")
            kit = ContextKit(dataclasses.replace(config, threads=None), progress=update)
    except ContextKitError as exc:
        _fail(str(exc))
    err.print(f"serving {model} as {served_model_name!r} on http://{host}:{port}/v1 (Ctrl-C stops)")
    try:
        uvicorn.run(create_serve_app(kit, served_model_name, tenancy, limits, engine_threads, metrics_key=metrics_key),
                    host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
    finally:
        kit.close()


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
