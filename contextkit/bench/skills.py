"""``contextkit bench skills [--skills DIR]``: skills spliced from compiled KV vs full prefill, and errata.

Skills come from ``DIR`` (default ``../shared/data/skills``, any folder laid out like it). Each skill's
body is cut at a line boundary to at most ``--set max_tokens=2048`` tokens and kept when it has at least
``--set min_tokens=1000`` (the band the target names: a ~2k-token skill plus a short task).

Skill rows. Per skill, a task written for it (``TASKS``; a skill without one gets a task derived from
its description), rendered by the planner: system prompt, the skill at the end of it, the task (~50
tokens). Each skill is compiled once beforehand (``SkillLibrary.compile(skill, system=SYSTEM)``,
reported apart): position-free, and as an exact prefix link after ``SYSTEM``. Two placements per task:

- canonical: after ``SYSTEM``, where the request reuses the link exactly (the default behaviour);
- spliced: the same task under another system prompt (``SPLICE_SYSTEM``), so the skill's position-free
  KV is re-positioned and recomputed per the row's policy: what splicing it anywhere costs.

Per method, in the same run and in a rotating order, TTFT is the wall time of ``SpanCache.assemble``
(fetch, re-rotate, select, recompute, task prefill) to the first token's logits; each placement's
``full`` row is the plain prefill of its tokens. Fidelity vs that full prefill: next-token KL,
first-token top-1 agreement, and ``answer_agreement_f1`` (token F1 of the 32-token greedy answer against
full prefill's). With ``--set pairs=N``, N tasks that need two skills (adjacent skills of the band) are
added; their second skill has no link after the first until a request computed it there (counted).

Erratum rows. Per skill, a field of it (the most frequent backticked name or number, or a capitalised
term) is edited. The edited skill recompiled (full prefill of the edited text) is the reference; the
question asks for the field by quoting its line with the field blanked. Compared: the stale skill
(no correction), the original skill's KV plus an appended erratum (the library's default for a small
edit), and the field's KV overwritten in place (the edited tokens recomputed where the old ones were,
the rest reused: what the published anchor says fails). A decision is which value the greedy answer
names (the new one, the old one, neither); ``erratum_agreement`` is the share of tasks where the
erratum path decides as the recompiled skill does.

Summary: ``speedup_vs_full``, ``top1_agreement``, ``kl_p50``, ``answer_agreement_f1`` (the default at
the canonical place), ``splice_speedup_vs_full``, ``splice_top1_agreement``, ``splice_kl_p50``,
``splice_answer_agreement_f1`` (the default policy spliced), ``erratum_agreement``, ``stale_agreement``,
``overwrite_agreement``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from pathlib import Path

import torch

from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.bench.metrics import kl_divergence, token_f1
from contextkit.core.errors import InputError
from contextkit.core.generation import SamplingParams
from contextkit.core.plan import PlanItem, RequestPlan, ReuseOptions
from contextkit.core.planner import ChatRequest
from contextkit.core.tenant import Tenant
from contextkit.core.types import Skill, Span
from contextkit.spans.compile import rotate_layers
from contextkit.spans.key import span_key
from contextkit.spans.store import CompiledSpan

SHARED_SKILLS = Path("../shared/data/skills")
SYSTEM = "You are a careful coding agent. Follow the skills below exactly when they apply."
# One task per skill of the shared folder, written from its description and body (what a user of that
# skill would ask); other folders' skills get a task derived from their description.
TASKS = {
    "algorithmic-art": "Make a p5.js sketch of a flow field with seeded randomness; what do I write first?",
    "brainstorming": "I want to add offline sync to our notes app. Before any code, how do we start?",
    "brand-guidelines": "Style this quarterly report slide deck in our brand colors and fonts. Which ones?",
    "claude-api": "Write a Python script that calls the Messages API with streaming. What do I import?",
    "dispatching-parallel-agents": "Three unrelated tests fail in different modules. How do I split the work?",
    "doc-coauthoring": "Help me write a design doc for the new billing service. What is the first step?",
    "executing-plans": "Here is the implementation plan from yesterday's session. How do I carry it out?",
    "finishing-a-development-branch": "All tests pass on my feature branch. What do I do before merging?",
    "frontend-design": "Design the landing page for a small bakery's website. What should I decide first?",
    "internal-comms": "Write this week's status update for leadership about the payments migration.",
    "requesting-code-review": "I finished the caching feature. How do I ask for a review of it?",
    "skill-creator": "I want a new skill that formats SQL queries. How do I create and test it?",
    "slack-gif-creator": "Make an animated GIF of a dancing cat for a Slack emoji. What size and frame rate?",
    "subagent-driven-development": "Run this five-task plan with subagents in this session. How do I start?",
    "test-driven-development": "Add a function that parses ISO dates to our utils module. Where do I begin?",
    "using-git-worktrees": "I need to work on a hotfix while my feature branch is half done. What do I do?",
    "using-superpowers": "A new conversation starts with a request to refactor the parser. What first?",
    "verification-before-completion": "I think the bug fix is done. What must I check before saying so?",
    "web-artifacts-builder": "Build a multi-page React dashboard artifact with charts. How do I set it up?",
    "writing-skills": "I wrote a skill about database migrations. How do I check it works before I ship it?",
}


DEFAULT = "default, canonical place (exact prefix)"
SPLICE_SYSTEM = "You are a coding agent. Use the skills below when they fit the task."
SPLICE_FULL = "spliced: full"
SPLICE_DEFAULT = f"spliced: default (r={ReuseOptions().ratio}, <={ReuseOptions().max_recompute})"


def methods() -> dict[str, tuple[ReuseOptions, str]]:
    """name -> (options, plan): "canonical" is the skill after the system prompt it was compiled for (an
    exact prefix link); "spliced" is the same task under another system prompt, so the skill's
    position-free KV is re-positioned and recomputed per the policy (each against its own full prefill)."""
    d = ReuseOptions()
    return {
        "full": (ReuseOptions(policy="full"), "canonical"),
        DEFAULT: (d, "canonical"),
        SPLICE_FULL: (ReuseOptions(policy="full"), "spliced"),
        "spliced: reuse": (ReuseOptions(policy="none", first_k=0), "spliced"),
        "spliced: first_k k=8": (ReuseOptions(policy="first_k", first_k=8), "spliced"),
        "spliced: query_attention r=0.1": (ReuseOptions(ratio=0.1, max_recompute=None), "spliced"),
        SPLICE_DEFAULT: (d, "spliced"),
    }


def _cut(text: str, tokens, limit: int) -> str:
    """The longest prefix of ``text`` ending at a line whose block fits ``limit`` tokens."""
    lines = text.splitlines(keepends=True)
    lo, hi = 1, len(lines)
    while lo < hi:  # tokens grow with lines: binary search the count of lines that fits
        mid = (lo + hi + 1) // 2
        if len(tokens("".join(lines[:mid]))) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def _field(text: str) -> str | None:
    """A field to edit: the most frequent backticked name or number (3-30 chars), else a capitalised term."""
    ticks = Counter(m for m in re.findall(r"`([A-Za-z0-9_.\-/]{3,30})`", text))
    nums = Counter(re.findall(r"(?<![\w.])(\d+(?:x\d+|\.\d+)?)(?![\w.])", text))
    for pool in (ticks, nums):
        for value, _ in pool.most_common():
            if text.count(value) <= 4:
                return value
    caps = Counter(re.findall(r"\b([A-Z][a-z]{3,}[A-Z]\w+)\b", text))
    return caps.most_common(1)[0][0] if caps else None


def _new_value(old: str) -> str:
    if re.fullmatch(r"\d+", old):
        return str(int(old) * 2 + 1)
    if re.fullmatch(r"\d+x\d+", old):
        a, b = old.split("x")
        return f"{int(a) * 2}x{int(b) * 2}"
    return old + "_v2" if old[-1].isalnum() else old + "v2"


def _decision(answer: str, old: str, new: str) -> str:
    if new in answer:
        return "new"
    if old in answer:
        return "old"
    return "neither"


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    from contextkit.kit import ContextKit
    from contextkit.synthesis.skills import SkillLibrary

    min_tokens, max_tokens = ctx.option("min_tokens", 1000, int), ctx.option("max_tokens", 2048, int)
    decode, pairs = ctx.option("decode_tokens", 32, int), ctx.option("pairs", 4, int)
    folder = Path(ctx.option("skills", str(SHARED_SKILLS))).expanduser()
    kit = ContextKit(ctx.config)
    try:
        source = SkillLibrary(kit.planner)
        registered = source.register(folder)
        tokens = lambda text: kit.tokenizer.encode(text)  # noqa: E731
        band: list[Skill] = []
        for s in sorted(registered, key=lambda s: s.name):
            text = _cut(s.text, tokens, max_tokens)
            if len(tokens(text)) >= min_tokens:
                band.append(kit.skills.add(s.name, text, s.description))
        if not band:
            raise InputError(f"no skill of {folder} has {min_tokens}..{max_tokens} tokens; widen --set "
                             "min_tokens=/max_tokens=")
        band = band[: ctx.count(len(band))]
        table = methods()
        tasks = [((s,), TASKS.get(s.name) or f"Help me with this: {s.description.split('.')[0]}.") for s in band]
        for i in range(min(pairs, len(band) - 1)):
            a, b = band[2 * i % len(band)], band[(2 * i + 1) % len(band)]
            tasks.append(((a, b), f"{TASKS.get(a.name, a.description)} Then: {TASKS.get(b.name, b.description)}"))
        tick(total=len(tasks) * len(table) + len(band) * 4)

        compile_ms = []
        for s in band:
            t0 = time.perf_counter()
            kit.skills.compile(s, system=SYSTEM)  # position-free, and an exact link after SYSTEM
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        params = SamplingParams(max_new_tokens=decode)
        per: dict[str, dict[str, list[float]]] = {m: {} for m in table}
        for qi, (skills, task) in enumerate(tasks):
            plans = {
                "canonical": kit.planner.plan(ChatRequest.ask(task, skills=skills, system=SYSTEM, max_new_tokens=decode)),
                "spliced": _unanchored(kit.planner.plan(ChatRequest.ask(task, skills=skills, system=SPLICE_SYSTEM,
                                                                        max_new_tokens=decode))),
            }
            names = list(table)
            order = names[qi % len(names):] + names[: qi % len(names)]
            out = {}
            for name in order:
                tick(f"{name} task {qi}")
                opts, where = table[name]
                plan = plans[where]
                t0 = time.perf_counter()
                asm = kit.spans.assemble(dataclasses.replace(plan, options=opts), extra_capacity=decode + 1)
                ttft = (time.perf_counter() - t0) * 1e3
                gen = _decode(kit, plan, asm, params)
                out[name] = (asm.logits[0], gen.text, ttft, asm.report)
            for name, (logits, text, ttft, report) in out.items():
                ref_logits, ref_text, _, _ = out["full" if table[name][1] == "canonical" else SPLICE_FULL]
                plan = plans[table[name][1]]
                m = per[name]
                m.setdefault("ttft", []).append(ttft)
                m.setdefault("kl", []).append(kl_divergence(ref_logits, logits))
                m.setdefault("top1", []).append(float(int(logits.argmax()) == int(ref_logits.argmax())))
                m.setdefault("agree", []).append(token_f1(text, ref_text))
                m.setdefault("context", []).append(report.context_tokens)
                m.setdefault("hits", []).append(report.hits)
                m.setdefault("skills", []).append(len([it for it in plan.items if it.span.kind == "skill"]))

        erratum = _errata(kit, band, params, tick)
    finally:
        kit.close()

    full_ttft = {"canonical": median(per["full"]["ttft"]), "spliced": median(per[SPLICE_FULL]["ttft"])}
    dflt = DEFAULT
    rows = [{
        "method": name, "tasks": len(m["ttft"]),
        "ttft_ms_p50": round(median(m["ttft"]), 1), "ttft_ms_p90": round(percentile(m["ttft"], 90), 1),
        "speedup_vs_full": round(full_ttft[table[name][1]] / median(m["ttft"]), 2),
        "kl_p50": round(median(m["kl"]), 4), "kl_p90": round(percentile(m["kl"], 90), 4),
        "top1_agreement": round(sum(m["top1"]) / len(m["top1"]), 3),
        "answer_agreement_f1": round(sum(m["agree"]) / len(m["agree"]), 3),
        "context_tokens_p50": median(m["context"]), "default": name == dflt,
    } for name, m in per.items()]
    rows += erratum["rows"]
    by = {r["method"]: r for r in rows}
    single = [i for i, (s, _) in enumerate(tasks) if len(s) == 1]
    summary = {
        "skills": len(band), "tasks": len(tasks), "default_method": dflt,
        "speedup_vs_full": by[dflt]["speedup_vs_full"], "top1_agreement": by[dflt]["top1_agreement"],
        "kl_p50": by[dflt]["kl_p50"], "answer_agreement_f1": by[dflt]["answer_agreement_f1"],
        "speedup_vs_full_one_skill": round(median([per["full"]["ttft"][i] for i in single])
                                           / median([per[dflt]["ttft"][i] for i in single]), 2),
        "splice_speedup_vs_full": by[SPLICE_DEFAULT]["speedup_vs_full"],
        "splice_top1_agreement": by[SPLICE_DEFAULT]["top1_agreement"], "splice_kl_p50": by[SPLICE_DEFAULT]["kl_p50"],
        "splice_answer_agreement_f1": by[SPLICE_DEFAULT]["answer_agreement_f1"],
        "full_ttft_ms_p50": by["full"]["ttft_ms_p50"], "compile_ms_p50_per_skill": round(median(compile_ms), 1),
        **{k: v for k, v in erratum.items() if k != "rows"},
    }
    config = {"model": ctx.config.model, "dtype": ctx.config.dtype, "splice_system": SPLICE_SYSTEM,
              "skills_dir": str(folder), "min_tokens": min_tokens,
              "max_tokens": max_tokens, "decode_tokens": decode, "pairs": pairs, "system": SYSTEM}
    return BenchResult("skills", config, rows, summary)


def _unanchored(plan: RequestPlan) -> RequestPlan:
    """The plan with its skills not anchored: spliced from their position-free KV wherever they are."""
    return dataclasses.replace(plan, items=tuple(dataclasses.replace(it, anchor=False) for it in plan.items))


def _decode(kit, plan: RequestPlan, asm, params: SamplingParams):
    from contextkit.engine.generate import generate

    return generate(kit.engine, kit.tokenizer, plan.ids, params, cache=asm.cache, first_logits=asm.logits)


def _errata(kit, band: list[Skill], params: SamplingParams, tick: Tick) -> dict:
    """Erratum vs recompiled edit vs stale skill vs overwritten field KV, decisions compared."""
    planner, spans = kit.planner, kit.spans
    decisions: dict[str, list[float]] = {"stale": [], "erratum": [], "overwrite": []}
    agree_f1: dict[str, list[float]] = {k: [] for k in decisions}
    ttft: dict[str, list[float]] = {k: [] for k in (*decisions, "recompiled")}
    fields = []
    reuse = ReuseOptions()
    for s in band:
        old = _field(s.text)
        if old is None:
            continue
        new = _new_value(old)
        line = next(ln for ln in s.text.splitlines() if old in ln).strip()
        cloze = line.replace(old, "____", 1)[:240]
        question = f'The skill says: "{cloze}". What exactly goes in the blank? Answer with the value only.'
        edited = Skill(s.name, s.text.replace(old, new), "edited", s.description)
        with_erratum = dataclasses.replace(s, errata=((old, new),))
        fields.append(old)
        answers = {}
        for name, skill, opts in (("recompiled", edited, ReuseOptions(policy="full")), ("stale", s, reuse),
                                  ("erratum", with_erratum, reuse)):
            tick(f"erratum {name} {s.name}")
            plan = planner.plan(ChatRequest.ask(question, skills=(skill,), system=SYSTEM, reuse=opts,
                                                max_new_tokens=params.max_new_tokens))
            t0 = time.perf_counter()
            asm = spans.assemble(plan, extra_capacity=params.max_new_tokens + 1)
            ttft[name].append((time.perf_counter() - t0) * 1e3)
            answers[name] = _decode(kit, plan, asm, params).text
        # the field's KV overwritten in place: the edited skill's tokens, reused from the original's KV
        # except where the tokens differ (those recomputed in their context, nothing appended)
        tick(f"erratum overwrite {s.name}")
        plan = planner.plan(ChatRequest.ask(question, skills=(edited,), system=SYSTEM, reuse=reuse,
                                            max_new_tokens=params.max_new_tokens))
        t0 = time.perf_counter()
        asm = _overwrite(kit, plan, planner.skill_tokens(s), params)
        ttft["overwrite"].append((time.perf_counter() - t0) * 1e3)
        answers["overwrite"] = _decode(kit, plan, asm, params).text
        want = _decision(answers["recompiled"], old, new)
        for name in decisions:
            decisions[name].append(float(_decision(answers[name], old, new) == want))
            agree_f1[name].append(token_f1(answers[name], answers["recompiled"]))
    if not fields:
        return {"rows": [], "erratum_agreement": None}
    rows = [{"method": f"erratum: {name}", "tasks": len(decisions[name]),
             "ttft_ms_p50": round(median(ttft[name]), 1),
             "decision_agreement": round(sum(decisions[name]) / len(decisions[name]), 3),
             "answer_agreement_f1": round(sum(agree_f1[name]) / len(agree_f1[name]), 3),
             "default": name == "erratum"} for name in decisions]
    rows.append({"method": "erratum: recompiled (reference)", "tasks": len(fields),
                 "ttft_ms_p50": round(median(ttft["recompiled"]), 1), "decision_agreement": 1.0,
                 "answer_agreement_f1": 1.0, "default": False})
    return {"rows": rows, "erratum_agreement": rows[1]["decision_agreement"],
            "stale_agreement": rows[0]["decision_agreement"], "overwrite_agreement": rows[2]["decision_agreement"],
            "erratum_fields": fields}


def _overwrite(kit, plan: RequestPlan, original_ids: tuple[int, ...], params: SamplingParams):
    """Assemble ``plan`` (whose skill is the edited text) from the original skill's compiled KV: the
    tokens both share keep the original's KV, the differing ones are recomputed in context."""
    spans = kit.spans
    i = next(j for j, it in enumerate(plan.items) if it.span.kind == "skill")
    edited_ids = plan.items[i].span.token_ids
    entry, _ = spans.compiled(Span(original_ids, "skill"))
    # align the two token sequences: a common prefix and suffix; the middle is the edit
    p = 0
    while p < min(len(original_ids), len(edited_ids)) and original_ids[p] == edited_ids[p]:
        p += 1
    q = 0
    while (q < min(len(original_ids), len(edited_ids)) - p
           and original_ids[-1 - q] == edited_ids[-1 - q]):
        q += 1
    # a span for the shared head and one for the shared tail (their KV cut from the original's), the
    # edited tokens between them computed in context
    head, tail = edited_ids[:p], edited_ids[len(edited_ids) - q:]
    mid = edited_ids[p: len(edited_ids) - q]
    store = spans.store
    # under a tenant of its own: these entries are approximate and must not be hit by anything else
    tenant = Tenant("bench-overwrite")
    items = list(plan.items[:i])
    if head:
        store.put(CompiledSpan(span_key(spans.identity, head, (), tenant), head,
                               entry.k[:, :, :p].contiguous(), entry.v[:, :, :p].contiguous()))
        items.append(PlanItem(Span(head, "skill", "head")))
    if mid:
        items.append(PlanItem(Span(mid, "skill", "edit"), reuse=False))
    if tail:
        start = len(original_ids) - q
        k, v = entry.k[:, :, start:].contiguous(), entry.v[:, :, start:].contiguous()
        rotate_layers(spans.engine, k, -start, k, spans.rerotator)  # stored as if it started at position 0
        store.put(CompiledSpan(span_key(spans.identity, tail, (), tenant), tail, k, v))
        items.append(PlanItem(Span(tail, "skill", "tail")))
    items.extend(plan.items[i + 1:])
    return spans.assemble(RequestPlan(tuple(items), plan.options, tenant), extra_capacity=params.max_new_tokens + 1)
