"""The commands that start or configure servers: ``proxy`` (in front of vLLM), ``connector`` (what a stock
vLLM needs to run a KV connector) and ``serve`` (the same API on the built-in engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from contextkit.cli.common import (
    ApiKeysFileOpt,
    CacheOpt,
    ClientTenantOpt,
    ModelOpt,
    RateLimitOpt,
    _fail,
    _need_local,
    _status,
    app,
    err,
)
from contextkit.core.config import DEFAULT_CACHE_DIR, ContextKitConfig, remote_url_forms
from contextkit.core.errors import ContextKitError


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
    api_keys_file: ApiKeysFileOpt = None,
    allow_client_tenant: ClientTenantOpt = None,
    upstream_api_key: Annotated[
        Optional[str], typer.Option(envvar="CONTEXTKIT_UPSTREAM_API_KEY",
                                    help="Key sent to the vLLM servers (started with --api-key).")
    ] = None,
    rate_limit: RateLimitOpt = None,
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
    from contextkit.integrations.proxy import serve

    flags = dict(upstreams=upstream or None, host=host, port=port, timeout_s=timeout_s, block_size=block_size,
                 model=model, api_keys_file=api_keys_file, allow_client_tenant=allow_client_tenant,
                 upstream_api_key=upstream_api_key, kv_connector=kv_connector, metrics_key=metrics_key,
                 upstream_events=upstream_events or None, route_slack=route_slack, session_affinity=session_affinity)
    settings = _proxy_settings(config, rate_limit, flags)
    try:
        serve(settings)
    except ContextKitError as exc:
        _fail(str(exc))


def _proxy_settings(config: Optional[Path], rate_limit: Optional[str], flags: dict):
    """The proxy's settings from its JSON file, the environment and the flags given (flags win); a bad value
    fails with the setting's name."""
    from pydantic import ValidationError

    from contextkit.integrations.edge.ratelimit import RateLimit
    from contextkit.integrations.proxy import load_settings

    if config is not None and not config.is_file():
        _fail(f"--config {config} does not exist")
    if rate_limit is not None:
        try:
            rate = RateLimit.parse(rate_limit)
        except ContextKitError as exc:
            _fail(f"--rate-limit: {exc}")
        flags = flags | dict(rate_per_s=rate and rate.rate_per_s, rate_burst=rate and rate.burst)
    try:
        return load_settings(config, **{k: v for k, v in flags.items() if v is not None})
    except (ValidationError, ValueError) as exc:
        errors = exc.errors() if isinstance(exc, ValidationError) else [{"loc": (), "msg": str(exc)}]
        where = ".".join(str(x) for x in errors[0]["loc"]) or "settings"
        hint = (" (pass --upstream URL, or set CONTEXTKIT_PROXY_UPSTREAMS='[\"http://...\"]')"
                if where == "upstreams" else "")
        _fail(f"{where}: {errors[0]['msg']}{hint}")


@app.command()
def connector(
    backend: Annotated[
        str, typer.Option(help="contextkit (our KV connector) or cacheblend (LMCache's CacheBlend, GPU).")
    ] = "contextkit",
    disk_dir: Annotated[Optional[Path], typer.Option(help="contextkit: a disk tier (survives restarts).")] = None,
    remote_url: Annotated[
        Optional[str], typer.Option(help=f"{remote_url_forms()}, shared by servers.")
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
        Optional[str], typer.Option(help=f"Shared LMCache remote tier: {remote_url_forms()}.")
    ] = None,
    kv_encrypt: Annotated[
        bool, typer.Option("--kv-encrypt",
                           help="Encrypt span KV in the disk and remote tiers (AES-256-GCM, key from the secret).")
    ] = False,
    api_key: Annotated[
        Optional[str], typer.Option(envvar="CONTEXTKIT_API_KEY",
                                    help="One API key (tenant \"default\"); clients send Authorization: Bearer KEY.")
    ] = None,
    api_keys_file: ApiKeysFileOpt = None,
    allow_client_tenant: ClientTenantOpt = None,
    rate_limit: RateLimitOpt = "10/20",
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
    import uvicorn

    from contextkit.core.config import KVStoreConfig
    from contextkit.core.tenancy import Tenancy, check_bind, load_api_keys
    from contextkit.integrations.edge.ratelimit import RateLimit
    from contextkit.integrations.serve.app import ServeLimits, create_serve_app

    try:
        config = ContextKitConfig(model=model, cache_dir=cache_dir, dtype=dtype, threads=threads,
                                  calibration=calibration,
                                  kvstore=KVStoreConfig(disk_dir=kv_disk_dir, remote_url=kv_remote_url,
                                                        encrypt=kv_encrypt))
        keys = load_api_keys(api_keys_file, {api_key: "default"} if api_key else None)
        tenancy = Tenancy(keys, config.load_secret(), bool(allow_client_tenant))
        limits = ServeLimits(rate=RateLimit.parse(rate_limit), compile_idle=compile_idle)
        err.print(check_bind(tenancy, host))
        kit, engine_threads = _load_kit(config)
    except ContextKitError as exc:
        _fail(str(exc))
    err.print(f"serving {model} as {served_model_name!r} on http://{host}:{port}/v1 (Ctrl-C stops)")
    try:
        uvicorn.run(create_serve_app(kit, served_model_name, tenancy, limits, engine_threads, metrics_key=metrics_key),
                    host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
    finally:
        kit.close()


def _load_kit(config: ContextKitConfig):
    """The kit (model loaded, with a spinner) and the torch threads its engine thread gets.

    The model loads on this thread with one torch thread and the engine thread gets them all: a thread that
    ran an OpenMP parallel region first makes the engine thread's forwards ~20% slower."""
    import dataclasses

    import torch

    from contextkit.kit import ContextKit

    engine_threads = config.threads or torch.get_num_threads()
    torch.set_num_threads(1)
    status, update = _status(err)
    with status:
        update("loading model")
        return ContextKit(dataclasses.replace(config, threads=None), progress=update), engine_threads
