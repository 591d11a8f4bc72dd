"""``contextkit bench skillcache [--skills DIR]``: does one canonical skill order keep popular skill sets warm
in vLLM's prefix cache, on the prompt path?

Workload (seeded by ``--seed``). Skills come from ``DIR`` (default ``../shared/data/skills``, any folder
laid out like it: ``SKILL.md`` files with front matter). Each skill's body is cut at a line boundary to
at most ``--set max_tokens=600`` tokens, so that a request with 3 skills plus its question stays under
~2k tokens and vLLM's KV space holds the run's prefixes. The arms share that space (below); at the
default size they store ~120k distinct tokens (~190k with the pasted arm). The vLLM the bench starts
gets ``--set kv_gib=4`` (~186k tokens: SmolLM2 in bf16 keeps 23 KB per token); a server started with
``VLLMServerConfig``'s 2 GiB (the suite's) holds ~93k, and one arm's misses then evict another's blocks
(LRU), which shows as a measured hit rate below the ideal one. Longer skills or a smaller KV space
measure eviction, not ordering. Popularity ranks are a seeded shuffle of the skills (so they do not
follow the names' order, which is the canonical order). Each of ``--n`` requests (default 120) needs 1
to ``--set max_skills=3`` skills, drawn without replacement by a Zipf law over those ranks (``--set
zipf=1.1``: weight 1/rank^zipf), listed in a random order as an agent framework lists them, under one
system prompt (``bench skills``' ``SYSTEM``), with a question of ``--data`` (default the shared
multi-hop set; the bundled example question in a clone).

Arms, on the same request stream, sent sequentially; per request the arms take turns (rotating which goes
first), so both see the same machine load. Each arm has its own tenant / ``cache_salt`` (unique per
run), so vLLM's prefix cache keeps them apart while they share its KV space:

- ``proxy, canonical`` (the default): ``contextkit proxy`` in its own process (as ``bench proxy`` starts
  it) in front of vLLM (``--upstream URL``, or one the bench starts and stops), the skills in the chat
  body's ``skills`` field: the planner renders them after the system prompt in one order (name, version).
- ``vLLM direct, request order``: straight to vLLM's ``/v1/completions`` as token ids, the same blocks
  rendered by the same planner (``Planner.frame`` and ``Planner.skill_tokens``) in the order the request
  listed them: what a client without contextkit sends. Only the order differs from the canonical arm
  (the bench checks that its canonical rendering is the planner's plan, token for token).
- ``proxy, pasted in request order`` (``--set pasted=1``): through the proxy without the ``skills``
  field, the same skill blocks pasted into the system message text in request order (tokenized whole;
  its block bounds and ideal are the request-order rendering's, off by a token or so at the joints).

Per arm: ``cached_share`` = sum(cached_tokens) / sum(prompt_tokens) (vLLM's
``usage.prompt_tokens_details.cached_tokens``); ``skill_hit_rate`` = the share of the skills block's
tokens served from cache (vLLM's cache is a prefix: cached tokens past the system prompt, up to the
block's length); ``ideal_skill_hit_rate``: the same from a simulated prefix cache of the arm's prompts
(32-token blocks, chained hashes, no eviction), so a gap to it is eviction; ``repeat_skill_hit_rate``:
the same over requests whose skill set came earlier in the stream; TTFT p50/p90/p99 (streaming, the
first chunk with a token; ``--set new_tokens=1`` generated); distinct skill lists as rendered (prefixes
the cache has to hold).

What the canonical order guarantees: a set seen before is served from cache up to the last whole block
of its skills, whatever order it is listed in (``repeat_skill_hit_rate`` ~1, never below request
order's, absent eviction). Over the whole stream it usually wins too, but not by construction: sets
that only overlap share a prefix when they start with the same skill, and sorting by name can put a
rare skill before a popular one where a random listing puts the popular one first half the time (on
small streams request order can come out ahead).

Summary: ``skill_hit_rate`` (canonical), ``skill_hit_rate_request_order``, ``cached_share``,
``cached_share_request_order``, ``ttft_ms_p50``, ``ttft_ms_p50_request_order``, ``ttft_vs_request_order``
(canonical TTFT p50 / request-order TTFT p50, same run), ``ttft_mean_vs_request_order`` (the same of
the means: TTFT is bimodal, hit or miss, and with about half the skill tokens hit the median sits
between the two modes and jumps between runs), ``repeat_skill_hit_rate``,
``repeat_skill_hit_rate_request_order``, ``ideal_skill_hit_rate``, ``ideal_skill_hit_rate_request_order``,
``distinct_skill_sets``, ``requests``, ``errors``, ``render_mismatches`` (requests whose prompt length
or reported skills differ from the local rendering: 0 unless the one-planner invariant broke).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from contextkit.bench.harness import BenchContext, BenchResult, Tick, percentile
from contextkit.bench.skill_workload import (
    Rendered,
    Renderer,
    SkillRequest,
    ideal_cached,
    load_skills,
    workload,
)
from contextkit.bench.skills import SHARED_SKILLS, SYSTEM
from contextkit.bench.stream_client import CompletionClient, stream
from contextkit.core.errors import ConfigError, InputError, UpstreamError
from contextkit.core.models import resolve_model_dir
from contextkit.core.planner import Planner
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Skill
from contextkit.integrations.launchers.servers import proxy_process
from contextkit.integrations.launchers.vllm_server import (
    VLLMServer,
    VLLMServerConfig,
    reset_prefix_cache,
    served_model,
)

CANONICAL = "proxy, canonical"
REQUEST_ORDER = "vLLM direct, request order"
PASTED = "proxy, pasted in request order"


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    skills: tuple[str, ...] = ()  # as the proxy reports them rendered (name@version)


def chat_stream(http: httpx.Client, url: str, body: dict) -> Sample:
    """One streaming chat through the proxy: TTFT (``stream_client``'s rule), and the usage and
    ``contextkit`` extension of its last chunk."""
    s = stream(http, url + "/v1/chat/completions", {**body, "stream": True}, where=url)
    if s.cached_tokens is None:
        raise UpstreamError("the upstream reports no cached_tokens; start vLLM with --enable-prompt-tokens-details")
    return Sample(s.ttft_ms, int(s.usage["prompt_tokens"]), int(s.cached_tokens),
                  tuple(s.contextkit.get("skills") or ()))


def _in_block(cached: int, r: Rendered) -> int:
    """Of ``cached`` tokens (a prefix: that is all a prefix cache serves), those inside the skills block."""
    return min(max(cached - r.skills_at, 0), r.skills_len)


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _row(arm: str, samples: list[tuple[Sample, Rendered, bool]], ideal: list[int], distinct: int,
         default: bool) -> dict:
    ms = [s.ttft_ms for s, _, _ in samples]
    prompt = sum(s.prompt_tokens for s, _, _ in samples)
    cached = sum(min(s.cached_tokens, s.prompt_tokens) for s, _, _ in samples)
    skill = sum(r.skills_len for _, r, _ in samples)
    again = sum(r.skills_len for _, r, seen in samples if seen)
    again_hit = sum(_in_block(s.cached_tokens, r) for s, r, seen in samples if seen)
    return {"arm": arm, "requests": len(samples), "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": _share(cached, prompt), "skill_tokens": skill,
            "skill_hit_rate": _share(sum(_in_block(s.cached_tokens, r) for s, r, _ in samples), skill),
            "ideal_skill_hit_rate": _share(sum(_in_block(c, r) for c, (_, r, _) in zip(ideal, samples)), skill),
            "repeat_skill_tokens": again,
            "repeat_skill_hit_rate": _share(again_hit, again),
            "ttft_ms_p50": round(percentile(ms, 50), 2), "ttft_ms_p90": round(percentile(ms, 90), 2),
            "ttft_ms_p99": round(percentile(ms, 99), 2), "ttft_ms_mean": round(sum(ms) / len(ms), 2),
            "distinct_skill_lists": distinct, "default": default}


@dataclass(frozen=True, slots=True)
class _Setup:
    """The run's options, and its workload rendered for every arm, before any server starts."""

    max_tokens: int
    zipf: float
    max_skills: int
    new_tokens: int
    block: int
    pasted: bool
    kv_gib: int
    folder: Path
    model_dir: Path
    planner: Planner
    skills: list[Skill]
    n: int
    requests: list[SkillRequest]
    renderer: Renderer
    arms: list[str]
    rendered: dict[str, list[Rendered]]
    tenant: dict[str, str]


def _setup(ctx: BenchContext) -> _Setup:
    from contextkit.bench.data import load_records, sample

    max_tokens = ctx.option("max_tokens", 600, int)
    zipf, max_skills = ctx.option("zipf", 1.1, float), ctx.option("max_skills", 3, int)
    new_tokens, block = ctx.option("new_tokens", 1, int), ctx.option("block_size", 32, int)
    pasted, kv_gib = bool(ctx.option("pasted", 0, int)), ctx.option("kv_gib", 4, int)
    if max_tokens < 16 or new_tokens < 1:
        raise ConfigError("--set max_tokens must be >= 16 and --set new_tokens >= 1")
    folder = Path(ctx.option("skills", str(SHARED_SKILLS))).expanduser()
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    planner = Planner(Tokenizer(model_dir), block_size=block)
    skills = load_skills(folder, planner, max_tokens)
    if len(skills) < 2:
        raise InputError(f"{folder} holds {len(skills)} skill(s); a skill-set workload needs at least 2")
    n = ctx.count(120)
    records = load_records(ctx.data)
    requests = workload(skills, [r.question for r in sample(records, n, ctx.seed)], n, zipf, max_skills, ctx.seed)
    renderer = Renderer(planner, new_tokens)
    arms = [CANONICAL, REQUEST_ORDER] + ([PASTED] if pasted else [])
    rendered = {arm: [renderer.render(r, canonical=arm == CANONICAL) for r in requests] for arm in arms}
    run_id = uuid.uuid4().hex[:12]  # tenants / salts no earlier run warmed
    tenant = {arm: f"skillcache-{run_id}-{i}" for i, arm in enumerate(arms)}
    return _Setup(max_tokens, zipf, max_skills, new_tokens, block, pasted, kv_gib, folder, model_dir, planner,
                  skills, n, requests, renderer, arms, rendered, tenant)


def _skill_sets(s: _Setup) -> list[frozenset[str]]:
    return [frozenset(k.name for k in r.skills) for r in s.requests]


def _send(s: _Setup, arm: str, i: int, *, direct: CompletionClient, http: httpx.Client, proxy: str,
          model: str) -> Sample:
    """Request ``i`` as the arm ``arm`` sends it: token ids straight to vLLM, or a chat through the proxy."""
    req, r = s.requests[i], s.rendered[arm][i]
    if arm == REQUEST_ORDER:
        c = direct.complete(r.ids, max_tokens=s.new_tokens, cache_salt=s.tenant[arm])
        return Sample(c.ttft_ms, c.prompt_tokens, c.cached_tokens or 0)
    system = SYSTEM if arm == CANONICAL else s.renderer.pasted_system(req)
    body = {"model": model, "max_tokens": s.new_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": req.question}],
            "contextkit": {"tenant": s.tenant[arm]}}
    if arm == CANONICAL:
        body["skills"] = [{"name": k.name, "text": k.text} for k in req.skills]
    return chat_stream(http, proxy, body)


def _send_all(s: _Setup, tick: Tick, *, upstream: str, model: str,
              proxy: str) -> tuple[dict[str, list[tuple[Sample, Rendered, bool]]], int, int]:
    """Every request through every arm, the arms taking turns; the samples per arm, errors, mismatches."""
    got: dict[str, list[tuple[Sample, Rendered, bool]]] = {arm: [] for arm in s.arms}
    sets = _skill_sets(s)
    repeat = [sets[i] in sets[:i] for i in range(s.n)]  # the set came before: all of its block can hit
    errors, mismatches = 0, 0
    with CompletionClient(upstream, model, timeout_s=600) as direct, httpx.Client(timeout=600) as http:
        for i, req in enumerate(s.requests):
            turn = s.arms[i % len(s.arms):] + s.arms[: i % len(s.arms)]
            for arm in turn:
                r = s.rendered[arm][i]
                try:
                    got_one = _send(s, arm, i, direct=direct, http=http, proxy=proxy, model=model)
                except UpstreamError:
                    errors += 1
                    continue
                # the proxy renders through the same planner: the same prompt length, the skills sorted
                want = [f"{k.name}@{k.version}" for k in sorted(req.skills, key=lambda k: k.name)]
                wrong_length = arm != PASTED and got_one.prompt_tokens != len(r.ids)
                mismatches += wrong_length or (arm == CANONICAL and list(got_one.skills) != want)
                got[arm].append((got_one, r, repeat[i]))
            tick(f"request {i + 1}")
    return got, errors, mismatches


def _measure(ctx: BenchContext, tick: Tick, s: _Setup) -> tuple[dict, int, int, bool]:
    """Start vLLM (unless ``--upstream``) and the proxy, send every request, stop them: the samples per
    arm, errors, mismatches, and whether vLLM's prefix cache was reset."""
    upstream = ctx.option("upstream", "")
    logs = ctx.config.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    server = proxy_proc = None
    try:
        tick(total=s.n)
        if not upstream:
            tick("starting vLLM", advance=0)
            server = VLLMServer(VLLMServerConfig(model_dir=s.model_dir, block_size=s.block, kv_cache_gib=s.kv_gib,
                                                 log_file=logs / "bench-skillcache-vllm.log")).start()
            upstream = server.url
        model = served_model(upstream)
        tick("starting the proxy", advance=0)
        proxy_proc = proxy_process(  # open on loopback with client-named tenants (one per arm)
            upstream=upstream, model=ctx.config.model, cache_dir=ctx.config.cache_dir,
            log_file=logs / "bench-skillcache-proxy.log", args=["--block-size", str(s.block), "--allow-client-tenant"],
        ).start()
        proxy = proxy_proc.url
        reset = reset_prefix_cache(upstream)  # a clean KV space when the server allows it (salts separate anyway)
        got, errors, mismatches = _send_all(s, tick, upstream=upstream, model=model, proxy=proxy)
    finally:
        if proxy_proc is not None:
            proxy_proc.stop(30)
        if server is not None:
            server.stop()
    if not all(got.values()):
        raise UpstreamError(f"an arm had no successful request ({errors} errors); see the logs in {logs}")
    return got, errors, mismatches, reset


def _arm_rows(s: _Setup, got: dict[str, list[tuple[Sample, Rendered, bool]]]) -> list[dict]:
    rows = []
    for arm in s.arms:
        done = [r for _, r, _ in got[arm]]  # the ideal cache sees the requests that were served
        lists = {tuple(k.name for k in (sorted(q.skills, key=lambda k: k.name) if arm == CANONICAL else q.skills))
                 for q in s.requests}
        rows.append(_row(arm, got[arm], ideal_cached([r.ids for r in done], s.block), len(lists), arm == CANONICAL))
    return rows


def _summary(s: _Setup, rows: list[dict], errors: int, mismatches: int) -> dict:
    by = {row["arm"]: row for row in rows}
    a, b = by[CANONICAL], by[REQUEST_ORDER]
    summary = {
        "skill_hit_rate": a["skill_hit_rate"], "skill_hit_rate_request_order": b["skill_hit_rate"],
        "cached_share": a["cached_share"], "cached_share_request_order": b["cached_share"],
        "ttft_ms_p50": a["ttft_ms_p50"], "ttft_ms_p50_request_order": b["ttft_ms_p50"],
        "ttft_vs_request_order": round(a["ttft_ms_p50"] / b["ttft_ms_p50"], 4),
        "ttft_mean_vs_request_order": round(a["ttft_ms_mean"] / b["ttft_ms_mean"], 4),
        "ideal_skill_hit_rate": a["ideal_skill_hit_rate"],
        "ideal_skill_hit_rate_request_order": b["ideal_skill_hit_rate"],
        "repeat_skill_hit_rate": a["repeat_skill_hit_rate"],
        "repeat_skill_hit_rate_request_order": b["repeat_skill_hit_rate"],
        "distinct_skill_sets": len(set(_skill_sets(s))), "requests": s.n, "errors": errors,
        "render_mismatches": mismatches,
    }
    if s.pasted:
        summary.update(skill_hit_rate_pasted=by[PASTED]["skill_hit_rate"], ttft_ms_p50_pasted=by[PASTED]["ttft_ms_p50"])
    return summary


def _config(ctx: BenchContext, s: _Setup, reset) -> dict:
    skills = s.skills
    return {"skills_folder": str(s.folder), "skills": len(skills), "max_tokens": s.max_tokens,
            "skill_tokens_mean": round(sum(len(s.planner.skill_tokens(k)) for k in skills) / len(skills), 1),
            "zipf": s.zipf, "max_skills": s.max_skills, "new_tokens": s.new_tokens, "block_size": s.block, "n": s.n,
            "seed": ctx.seed, "data": str(ctx.data) if ctx.data else "default",
            "distinct_questions": len({r.question for r in s.requests}), "arms": s.arms,
            "upstream": ctx.option("upstream", "") or f"started by the bench ({s.kv_gib} GiB of KV)",
            "prefix_cache_reset": reset,
            "system": SYSTEM}


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    s = _setup(ctx)
    got, errors, mismatches, reset = _measure(ctx, tick, s)
    rows = _arm_rows(s, got)
    summary = _summary(s, rows, errors, mismatches)
    return BenchResult("skillcache", _config(ctx, s, reset), rows, summary)


def plot(result: BenchResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = result.rows
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["arm"].replace(", ", "\n") for r in rows]
    left.bar(names, [r["skill_hit_rate"] for r in rows])
    left.set_ylabel("skills block served from cache")
    right.bar(names, [r["ttft_ms_p50"] for r in rows])
    right.set_ylabel("TTFT p50 (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
