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

Erratum rows (``contextkit.bench.errata``): per skill, 1, 2 or 4 fields edited (``--set
errata_counts=1,2,4``); the recompiled edited skill is the reference; the stale skill, the original's KV
plus appended errata (the library's default for small edits) and the fields' KV overwritten in place are
compared by a forced choice between the new and the old value; ``erratum_agreement`` is the share of
single-edit tasks where the erratum path decides as the recompiled skill does.

Summary: ``speedup_vs_full``, ``top1_agreement``, ``kl_p50``, ``answer_agreement_f1`` (the default at
the canonical place), ``splice_speedup_vs_full``, ``splice_top1_agreement``, ``splice_kl_p50``,
``splice_answer_agreement_f1`` (the default policy spliced); ``tf_agreement``, ``answer_kl_p90``,
``splice_tf_agreement``, ``splice_answer_kl_p90``: the whole answer teacher-forced against full prefill on the
same engine (``spans.fidelity``); ``erratum_agreement``, ``stale_agreement``,
``overwrite_agreement`` (single edits), ``erratum_agreement_by_edits``, ``erratum_agreement_heldout``,
``field_attention_share_p50`` (the answer's attention on the edited field's own tokens).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from contextkit.bench.answers import answered
from contextkit.bench.errata import run_errata
from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.bench.metrics import kl_divergence, token_f1
from contextkit.core.errors import InputError
from contextkit.core.generation import SamplingParams
from contextkit.core.plan import RequestPlan
from contextkit.core.planner import ChatRequest
from contextkit.core.policy import ReuseOptions
from contextkit.core.types import Skill
from contextkit.spans.fidelity import score

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
SPLICE_DEFAULT = f"spliced: default (budget {ReuseOptions().budget})"


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
        "spliced: query_attention r=0.1": (ReuseOptions(policy="query_attention", ratio=0.1, max_recompute=None),
                                           "spliced"),
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


def _band(kit, folder: Path, min_tokens: int, max_tokens: int) -> list[Skill]:
    """The folder's skills cut to ``max_tokens`` and kept when at least ``min_tokens``, added to the kit."""
    from contextkit.synthesis.skills import SkillLibrary

    source = SkillLibrary(kit.planner)
    registered = source.register(folder)
    tokens = lambda text: kit.tokenizer.encode(text)
    band: list[Skill] = []
    for s in sorted(registered, key=lambda s: s.name):
        text = _cut(s.text, tokens, max_tokens)
        if len(tokens(text)) >= min_tokens:
            band.append(kit.skills.add(s.name, text, s.description))
    if not band:
        raise InputError(f"no skill of {folder} has {min_tokens}..{max_tokens} tokens; widen --set "
                         "min_tokens=/max_tokens=")
    return band


def _tasks(band: list[Skill], pairs: int) -> list[tuple[tuple[Skill, ...], str]]:
    """One task per skill, then ``pairs`` tasks that need two adjacent skills."""
    tasks = [((s,), TASKS.get(s.name) or f"Help me with this: {s.description.split('.')[0]}.") for s in band]
    for i in range(min(pairs, len(band) - 1)):
        a, b = band[2 * i % len(band)], band[(2 * i + 1) % len(band)]
        tasks.append(((a, b), f"{TASKS.get(a.name, a.description)} Then: {TASKS.get(b.name, b.description)}"))
    return tasks


def _task(kit, qi: int, skills: tuple[Skill, ...], task: str, table: dict, *, decode: int,
          params: SamplingParams, tick: Tick) -> tuple[dict[str, RequestPlan], dict[str, tuple]]:
    """One task at both placements, every method in a rotating order: (plans, name -> (logits, answer,
    ttft ms, report))."""
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
        kv, gen = answered(kit.engine, kit.tokenizer, plan.ids, asm.cache, asm.logits, params)  # scored in _record
        out[name] = (asm.logits[0], gen.text, ttft, asm.report, kv)
    return plans, out


def _record(per: dict[str, dict[str, list[float]]], table: dict, plans: dict[str, RequestPlan],
            out: dict[str, tuple]) -> None:
    """Append one task's measurements per method, each against its placement's full prefill (same dtype:
    the skills have no gold answer, and the kit runs one engine)."""
    whole = {}
    for where, ref in (("canonical", "full"), ("spliced", SPLICE_FULL)):
        kvs = {name: o[4] for name, o in out.items() if table[name][1] == where}
        whole |= score(kvs, same_dtype=ref, fp32=None, gold=None)
    for name, (logits, text, ttft, report, _) in out.items():
        ref_logits, ref_text, _, _, _ = out["full" if table[name][1] == "canonical" else SPLICE_FULL]
        plan = plans[table[name][1]]
        m = per[name]
        m.setdefault("ttft", []).append(ttft)
        m.setdefault("kl", []).append(kl_divergence(ref_logits, logits))
        m.setdefault("top1", []).append(float(int(logits.argmax()) == int(ref_logits.argmax())))
        m.setdefault("agree", []).append(token_f1(text, ref_text))
        m.setdefault("tf", []).append(whole[name]["tf_agreement"])
        m.setdefault("answer_kl", []).append(whole[name]["answer_kl"])
        m.setdefault("context", []).append(report.context_tokens)
        m.setdefault("hits", []).append(report.hits)
        m.setdefault("skills", []).append(len([it for it in plan.items if it.span.kind == "skill"]))


def _rows(per: dict[str, dict[str, list[float]]], table: dict) -> list[dict]:
    full_ttft = {"canonical": median(per["full"]["ttft"]), "spliced": median(per[SPLICE_FULL]["ttft"])}
    return [{
        "method": name, "tasks": len(m["ttft"]),
        "ttft_ms_p50": round(median(m["ttft"]), 1), "ttft_ms_p90": round(percentile(m["ttft"], 90), 1),
        "speedup_vs_full": round(full_ttft[table[name][1]] / median(m["ttft"]), 2),
        "kl_p50": round(median(m["kl"]), 4), "kl_p90": round(percentile(m["kl"], 90), 4),
        "top1_agreement": round(sum(m["top1"]) / len(m["top1"]), 3),
        "answer_agreement_f1": round(sum(m["agree"]) / len(m["agree"]), 3),
        "tf_agreement": round(sum(m["tf"]) / len(m["tf"]), 3),
        "answer_kl_p50": round(median(m["answer_kl"]), 4), "answer_kl_p90": round(percentile(m["answer_kl"], 90), 4),
        "context_tokens_p50": median(m["context"]), "default": name == DEFAULT,
    } for name, m in per.items()]


def _summary(rows: list[dict], per: dict[str, dict[str, list[float]]], tasks: list, band: list[Skill],
             compile_ms: list[float], erratum: dict) -> dict:
    dflt = DEFAULT
    by = {r["method"]: r for r in rows}
    single = [i for i, (s, _) in enumerate(tasks) if len(s) == 1]
    return {
        "skills": len(band), "tasks": len(tasks), "default_method": dflt,
        "speedup_vs_full": by[dflt]["speedup_vs_full"], "top1_agreement": by[dflt]["top1_agreement"],
        "kl_p50": by[dflt]["kl_p50"], "answer_agreement_f1": by[dflt]["answer_agreement_f1"],
        "speedup_vs_full_one_skill": round(median([per["full"]["ttft"][i] for i in single])
                                           / median([per[dflt]["ttft"][i] for i in single]), 2),
        "splice_speedup_vs_full": by[SPLICE_DEFAULT]["speedup_vs_full"],
        "splice_top1_agreement": by[SPLICE_DEFAULT]["top1_agreement"], "splice_kl_p50": by[SPLICE_DEFAULT]["kl_p50"],
        "splice_answer_agreement_f1": by[SPLICE_DEFAULT]["answer_agreement_f1"],
        "tf_agreement": by[dflt]["tf_agreement"], "answer_kl_p90": by[dflt]["answer_kl_p90"],
        "splice_tf_agreement": by[SPLICE_DEFAULT]["tf_agreement"],
        "splice_answer_kl_p90": by[SPLICE_DEFAULT]["answer_kl_p90"],
        "full_ttft_ms_p50": by["full"]["ttft_ms_p50"], "compile_ms_p50_per_skill": round(median(compile_ms), 1),
        **{k: v for k, v in erratum.items() if k != "rows"},
    }


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    from contextkit.kit import ContextKit

    min_tokens, max_tokens = ctx.option("min_tokens", 1000, int), ctx.option("max_tokens", 2048, int)
    decode, pairs = ctx.option("decode_tokens", 32, int), ctx.option("pairs", 4, int)
    counts = tuple(int(c) for c in ctx.option("errata_counts", "1,2,4", str).split(","))
    folder = Path(ctx.option("skills", str(SHARED_SKILLS))).expanduser()
    kit = ContextKit(ctx.config)
    try:
        band = _band(kit, folder, min_tokens, max_tokens)
        band = band[: ctx.count(len(band))]
        table = methods()
        tasks = _tasks(band, pairs)
        tick(total=len(tasks) * len(table) + len(band) * 4)

        compile_ms = []
        for s in band:
            t0 = time.perf_counter()
            kit.skills.compile(s, system=SYSTEM)  # position-free, and an exact link after SYSTEM
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        params = SamplingParams(max_new_tokens=decode)
        per: dict[str, dict[str, list[float]]] = {m: {} for m in table}
        for qi, (skills, task) in enumerate(tasks):
            plans, out = _task(kit, qi, skills, task, table, decode=decode, params=params, tick=tick)
            _record(per, table, plans, out)

        erratum = run_errata(kit, band, SYSTEM, tick, counts)
    finally:
        kit.close()

    rows = _rows(per, table) + erratum["rows"]
    summary = _summary(rows, per, tasks, band, compile_ms, erratum)
    config = {"model": ctx.config.model, "dtype": ctx.config.dtype, "splice_system": SPLICE_SYSTEM,
              "skills_dir": str(folder), "min_tokens": min_tokens,
              "max_tokens": max_tokens, "decode_tokens": decode, "pairs": pairs, "system": SYSTEM,
              "errata_counts": list(counts)}
    return BenchResult("skills", config, rows, summary)


def _unanchored(plan: RequestPlan) -> RequestPlan:
    """The plan with its skills not anchored: spliced from their position-free KV wherever they are."""
    return dataclasses.replace(plan, items=tuple(dataclasses.replace(it, anchor=False) for it in plan.items))

