"""``contextkit bench agent [--data TRACES]``: an agent loop whose turns reuse the KV of the turns before.

Real agent trajectories (``../shared/data/traces/swe_agent_traces.jsonl``, or ``--data`` with any JSONL of
``{"id", "messages": [{role, content, action?}]}``) are replayed as the framework sends them: before each
assistant turn the whole conversation so far (system prompt, task, earlier actions, tool outputs) is one
chat request. An assistant message is its content and its ``action`` (the command it ran). A trajectory
stops at ``--set max_tokens=3072`` prompt tokens (``--n`` trajectories, default all).

Per request, in the same run, on one engine:

- ``full``: the plain prefill of the prompt (what a framework in front of an engine without a prefix
  cache pays every turn);
- ``turns`` (the default): the planner's plan with the default ``ReuseOptions``: the conversation is
  cut where each assistant message starts, the previous request is an exact prefix link it left
  (``PlanItem.exact``: never re-positioned), the answer and the messages after it are computed in
  context.

Per method TTFT (assembly or prefill to the first token's logits); fidelity of ``turns`` vs ``full`` as
next-token KL and top-1 agreement (both bf16: the turns path computes the same tokens in chunks, so the
difference is float rounding); reused share = exact tokens / prompt tokens. Also counted: tool outputs
that recur verbatim within a trajectory (what position-free reuse of tool outputs could add).

Summary: ``speedup_vs_full`` (TTFT p50 ratio), ``turn_ttft_ms_p50``, ``full_ttft_ms_p50``, ``kl_p50``,
``kl_max``, ``top1_agreement``, ``reused_share``, ``requests``, ``repeated_tool_outputs``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.bench.metrics import kl_divergence
from contextkit.core.errors import InputError, PromptTooLongError
from contextkit.core.planner import ChatRequest
from contextkit.core.policy import ReuseOptions
from contextkit.core.types import ROLES, Message

SHARED_TRACES = Path("../shared/data/traces/swe_agent_traces.jsonl")


def load_trajectories(path: Path) -> list[tuple[str, list[Message]]]:
    """(id, messages) per line; an assistant message's ``action`` is appended to its content."""
    if not path.is_file():
        raise InputError(f"{path} is not a file; pass --data with a JSONL of agent trajectories "
                         '({"id", "messages": [{"role", "content"}]})', "data")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            msgs = []
            for m in row["messages"]:
                text = m.get("content") or ""
                if isinstance(text, list):  # content parts: their text
                    text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
                if m["role"] == "assistant" and m.get("action"):
                    text = f"{text}\n{m['action']}".strip()
                if m["role"] not in ROLES:
                    raise ValueError(f"role {m['role']!r}")
                msgs.append(Message(m["role"], text))
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{path}:{n}: not an agent trajectory ({exc}); each line needs "
                             '{"messages": [{"role", "content"}]}', "data") from None
        out.append((str(row.get("id", n)), msgs))
    return out


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    from contextkit.kit import ContextKit

    max_tokens = ctx.option("max_tokens", 3072, int)
    trajectories = load_trajectories(Path(ctx.data) if ctx.data else SHARED_TRACES)
    trajectories = trajectories[: ctx.count(len(trajectories))]
    kit = ContextKit(ctx.config)
    reuse = ReuseOptions()
    ttft: dict[str, list[float]] = {"full": [], "turns": []}
    kl, top1, reused, prompt_tokens = [], [], [], []
    repeated = outputs = 0
    try:
        requests = []
        for tid, msgs in trajectories:
            seen = set()
            for m in msgs[2:]:  # after the system prompt and the task: observations
                if m.role in ("tool", "user"):
                    outputs += 1
                    repeated += m.content in seen
                    seen.add(m.content)
            for t, m in enumerate(msgs):
                if m.role == "assistant" and t > 1:
                    try:
                        plan = kit.planner.plan(ChatRequest(tuple(msgs[:t]), reuse=reuse, tenant=kit_tenant(tid),
                                                            max_new_tokens=1))
                    except PromptTooLongError:
                        break
                    if len(plan.ids) > max_tokens:
                        break
                    requests.append(plan)
        if not requests:
            raise InputError(f"no request of the trajectories fits --set max_tokens={max_tokens}", "data")
        tick(total=len(requests))
        for qi, plan in enumerate(requests):
            tick(f"request {qi} ({len(plan.ids)} tokens)")
            out = {}
            for name in (("full", "turns") if qi % 2 else ("turns", "full")):
                p = dataclasses.replace(plan, options=ReuseOptions(policy="full")) if name == "full" else plan
                t0 = time.perf_counter()
                asm = kit.spans.assemble(p, extra_capacity=1)
                ttft[name].append((time.perf_counter() - t0) * 1e3)
                out[name] = asm
            ref, got = out["full"].logits, out["turns"].logits
            kl.append(kl_divergence(ref, got))
            top1.append(float(int(ref.argmax()) == int(got.argmax())))
            reused.append(out["turns"].report.exact_tokens)
            prompt_tokens.append(len(plan.ids))
    finally:
        kit.close()
    rows = [{
        "method": name, "requests": len(v), "ttft_ms_p50": round(median(v), 1),
        "ttft_ms_p90": round(percentile(v, 90), 1),
        "speedup_vs_full": round(median(ttft["full"]) / median(v), 2),
        **({"kl_p50": round(median(kl), 5), "kl_max": round(max(kl), 5),
            "top1_agreement": round(sum(top1) / len(top1), 3),
            "reused_share": round(sum(reused) / sum(prompt_tokens), 3)} if name == "turns" else
           {"kl_p50": 0.0, "top1_agreement": 1.0, "reused_share": 0.0}),
        "prompt_tokens_p50": median(prompt_tokens), "default": name == "turns",
    } for name, v in ttft.items()]
    by = {r["method"]: r for r in rows}
    summary = {
        "requests": len(requests), "trajectories": len(trajectories),
        "speedup_vs_full": by["turns"]["speedup_vs_full"], "turn_ttft_ms_p50": by["turns"]["ttft_ms_p50"],
        "full_ttft_ms_p50": by["full"]["ttft_ms_p50"], "kl_p50": by["turns"]["kl_p50"],
        "kl_max": by["turns"]["kl_max"], "top1_agreement": by["turns"]["top1_agreement"],
        "reused_share": by["turns"]["reused_share"], "repeated_tool_outputs": repeated, "tool_outputs": outputs,
    }
    config = {"model": ctx.config.model, "dtype": ctx.config.dtype,
              "data": str(ctx.data) if ctx.data else str(SHARED_TRACES), "max_tokens": max_tokens}
    return BenchResult("agent", config, rows, summary)


def kit_tenant(trajectory: str) -> str:
    """One tenant per trajectory: a session reuses its own turns, never another session's."""
    return "traj-" + hashlib.sha256(trajectory.encode()).hexdigest()[:16]
