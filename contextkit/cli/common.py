"""What every ``contextkit`` command shares: the app, the consoles, the common options, failing cleanly."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Context-reuse middleware for RAG and agents.")
err = Console(stderr=True)
out = Console()

CacheOpt = Annotated[
    Path,
    typer.Option("--cache-dir", envvar="CONTEXTKIT_CACHE_DIR", help="Where prepared models are kept."),
]
ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", envvar="CONTEXTKIT_MODEL", help="Packaged model name or model directory."),
]
# the edge's options, the same on proxy and serve (None on serve: off; on the proxy: its config file decides)
ApiKeysFileOpt = Annotated[
    Optional[Path],
    typer.Option(help="JSON {\"<key>\": \"<tenant>\"}: clients authenticate, the tenant comes from the key."),
]
ClientTenantOpt = Annotated[
    Optional[bool],
    typer.Option("--allow-client-tenant", help="Let a key choose sub-tenants of its own (contextkit.tenant)."),
]
RateLimitOpt = Annotated[
    Optional[str],
    typer.Option(help="Requests per second per tenant, RATE or RATE/BURST (e.g. 10/20); 429 past it, before the body "
                      "is read. 0: no limit. Default: 10/20 on serve; none on the proxy, as vLLM."),
]


def _fail(message: str) -> None:
    # escaped: a message may hold brackets (pip install 'contextkit[local]') that rich would take as markup
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _need_local(command: str) -> None:
    """On a light install (proxy, client extra), a command that runs the built-in engine names its extra."""
    from contextkit.core.extras import LOCAL_EXTRA, missing

    if lacking := missing():
        _fail(f"`contextkit {command}` runs the built-in engine, which this install lacks ({', '.join(lacking)} "
              f"missing): {LOCAL_EXTRA}")


def _status(console: Console):
    """A spinner whose text follows the progress callback."""
    status = console.status("starting")

    def update(msg: str) -> None:
        status.update(msg)

    return status, update




def parse_sets(option: list[str], **named: object) -> dict[str, str]:
    """``--set KEY=VALUE`` options as a dict, plus the ``named`` flags that were given (as strings)."""
    try:
        extra = dict(kv.split("=", 1) for kv in option)
    except ValueError:
        _fail(f"--set takes KEY=VALUE, got {option!r}")
    return extra | {key: str(value) for key, value in named.items() if value is not None}
