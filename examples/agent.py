"""A plain-Python agent loop on the SDK: a skill, real tool outputs, a multi-turn session and parallel
sub-agents whose KV a synthesizer reads. Runs in process on the embedded default model, no server.

    python examples/agent.py

Every step prints its reuse report: what came from cached KV, what was recomputed and prefilled.
"""

from __future__ import annotations

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


def main() -> None:
    client = contextkit.connect()  # SmolLM2-135M-Instruct, in process
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
    print(f"\n[{r.prompt_tokens} prompt tokens in the last step, prefill {final.ttft_ms:.0f} ms]")
    client.close()


if __name__ == "__main__":
    main()
