"""A plain-Python agent loop on the SDK: a skill, real tool outputs, a multi-turn session and parallel
sub-agents whose KV a synthesizer reads. The same calls in process or over HTTP:

    python examples/agent.py                                   # in process, the embedded default model
    python examples/agent.py --serve                           # over HTTP to a contextkit serve started here
    python examples/agent.py --url http://localhost:8000 --api-key KEY   # a running contextkit serve

Over HTTP the sub-agents are ordinary chat completions that ask serve to keep their KV, and the synthesis
is a chat that carries their notes as text and names their response ids (docs/servers.md, "Parallel
agents over HTTP"): it reads their KV where serve still holds it, their text otherwise.

Every step prints its reuse report: what came from cached KV, what was recomputed and prefilled.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from pathlib import Path

import contextkit

SKILL = contextkit.Skill(
    "python-env-report",
    "When asked about the Python environment, report the interpreter version and the platform exactly as the "
    "tool output gives them, in one short sentence. Never guess a version: read it from the tool output.",
)


def report(step: str, a: contextkit.Answer) -> None:
    r = a.report
    print(f"{step}: {a.text.strip()!r}")
    print(f"   {r.prompt_tokens} prompt tokens: {r.reused_tokens} reused ({r.cached_tokens} already cached), "
          f"{r.recomputed_tokens} recomputed, {r.prefilled_tokens} prefilled; TTFT {a.ttft_ms:.0f} ms")


@contextlib.contextmanager
def connected(url: str | None, api_key: str | None, serve: bool):
    """A client: to ``url``; to a serve started here (``serve``); else in process."""
    if url or not serve:
        with contextkit.connect(url, api_key=api_key) if url else contextkit.connect() as client:
            yield client
        return
    from contextkit import ContextKit
    from contextkit.integrations.launchers.inprocess import AppThread
    from contextkit.integrations.serve.app import create_serve_app

    with ContextKit() as kit, AppThread(create_serve_app(kit, "contextkit")) as s, contextkit.connect(s.url) as client:
        yield client


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running contextkit serve (default: in process)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--serve", action="store_true", help="start a contextkit serve here and talk HTTP to it")
    args = ap.parse_args()
    with connected(args.url, args.api_key, args.serve) as client:
        run(client)


def run(client: contextkit.Client) -> None:
    print(f"[{client.transport.name}]")
    skills = Path(__file__).resolve().parents[2] / "shared" / "data" / "skills"
    if skills.is_dir():  # the repository's skill documents, when beside it: retrieve one by meaning
        client.skills.register(skills)
        best, score = client.skills.retrieve("write a plan before touching code", k=1)[0]
        print(f"retrieved skill {best.name!r} (cosine {score:.2f}) from {len(client.skills.names)} registered")

    session = client.session(system="You are a careful assistant that uses tools.", max_tokens=32)
    # turn 1: the agent decides what to look up; the skill's KV is compiled once and reused after
    report("step 1", session.ask("Which Python version runs here? Say which tool you need.", skills=[SKILL]))
    # a real tool: the interpreter itself
    session.tool("python_info", f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    report("step 2", session.ask("Now answer: which Python version runs here?", skills=[SKILL]))

    # parallel sub-agents: one shared prefix (its KV computed once), each branch reads its own material
    files = [Path(sys.executable).name, Path(contextkit.__file__).name]
    team = client.fork("You are a sub-agent. Describe the file name you are given in one short sentence.\n",
                       [f"File name: {f}\nDescription:" for f in files], max_tokens=24)
    for b in team.branches:
        print(f"sub-agent {b.index + 1}: {b.text.strip()!r}")
    final = team.join("You combine the sub-agents' notes into one sentence about this environment.\n",
                      "\n\nOne sentence:", max_tokens=32)
    report("synthesis (reads the branches' KV)", final)
    r = final.report
    if r.handles:  # over HTTP: how serve read each sub-agent's answer (kv, or why it used the text)
        print(f"sub-agent answers read: {[read for _, read in r.handles]}")
    print(f"\n[{r.prompt_tokens} prompt tokens in the last step, prefill {final.ttft_ms:.0f} ms]")


if __name__ == "__main__":
    main()
