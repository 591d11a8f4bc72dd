"""``contextkit bench ordering``: the same RAG request stream sent to a real vLLM server (prefix caching
on) once per ordering policy, measuring TTFT, prompt tokens served from the server's cache, ordering
overhead and answer quality.

Policies: ``retrieval`` (the retriever's order: the baseline), ``weaver`` (greedy walk of the prefix
tree), ``weaver+aligned`` (the same, every document padded to the engine's block size), ``oracle``
(the best order the same tree allows, found exactly). Before each policy the server's prefix cache is
emptied (``POST /reset_prefix_cache``; the server this bench starts runs in dev mode). On a server that
refuses it, each policy gets its own cache salt instead, which isolates it just as well.

Each request is rendered to token ids the way ``contextkit.core.prompt`` renders them (chat template prefix,
one separately tokenized block per document, question) and sent as a token-id prompt, streaming, greedy,
with the tenant as vLLM's ``cache_salt``.

Options (``--set KEY=VALUE``): ``k`` (10), ``block_size`` (32, vLLM's on CPU), ``max_tokens`` (24),
``policies`` (comma list), ``tree_sequences`` (10000: size of the tree for the overhead measurement).
``--upstream URL`` uses a running server; ``--trace FILE`` replays a trace; ``--write-trace FILE``.

Summary: ``ttft_reduction_vs_retrieval`` (1 - weaver TTFT p50 / retrieval TTFT p50);
``share_of_oracle_gain`` (weaver's extra cached prompt tokens over retrieval order as a fraction of the
oracle's, from the server's own ``cached_tokens``; ``share_of_oracle_ttft_gain`` is the same on median
TTFT, noisier); ``answer_f1_delta`` (weaver minus retrieval, F1 in points of 100);
``overhead_us_p50`` (one ``order`` call at k documents with ``tree_sequences`` sequences in the tree).
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from pathlib import Path

from contextkit.bench.harness import (
    BenchContext,
    BenchResult,
    Tick,
    percentile,
    timing_stats,
)
from contextkit.bench.metrics import answer_em, answer_f1
from contextkit.bench.stream_client import CompletionClient
from contextkit.bench.workload import (
    TraceRequest,
    WorkloadSpec,
    generate,
    read_trace,
    write_trace,
)
from contextkit.core.align import pad_to_block
from contextkit.core.errors import ConfigError
from contextkit.core.models import resolve_model_dir
from contextkit.core.planner import ChatRequest, FixedOrder, Planner
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Doc, Evidence, Message
from contextkit.integrations.launchers.vllm_server import (
    VLLMServer,
    VLLMServerConfig,
    reset_prefix_cache,
    served_model,
)
from contextkit.ordering.weaver import Weaver, oracle

POLICIES = ("retrieval", "weaver", "weaver+aligned", "oracle")


def load_stream(ctx: BenchContext, k: int) -> list[TraceRequest]:
    trace = ctx.option("trace", None)
    if trace:
        requests = read_trace(Path(trace))  # all of it unless --n says otherwise
        requests = requests[: ctx.n] if ctx.n is not None else requests
    else:
        from contextkit.bench.data import load_records
        from contextkit.bench.retrieval import Retriever, passage_pool

        records = load_records(ctx.data)
        retriever = Retriever(passage_pool(records), ctx.config.cache_dir)
        requests = generate(records, retriever, WorkloadSpec(requests=ctx.count(200), k=k, seed=ctx.seed))
    out = ctx.option("write_trace", None)
    if out:
        write_trace(requests, Path(out))
    return requests


class TraceRenderer:
    """Trace requests through the planner the proxy uses (``contextkit.core.planner``), so a bench that
    sends token ids straight to vLLM sends exactly the tokens the proxy would."""

    def __init__(self, tokenizer: Tokenizer, block_size: int):
        self.planner = Planner(tokenizer, block_size)
        self.tok = tokenizer

    @staticmethod
    def request(req: TraceRequest, aligned: bool = False) -> ChatRequest:
        docs = tuple(Evidence(d.text, id=d.id, title=d.title or None) for d in req.documents)
        return ChatRequest((Message("user", req.question),), docs, ordering="weaver", block_align=aligned)

    def doc_tokens(self, req: TraceRequest) -> list[tuple[int, ...]]:
        return [self.planner.document_tokens(e) for e in self.request(req).documents]

    def prefix(self, req: TraceRequest) -> tuple[int, ...]:
        return self.planner.frame(self.request(req))[0]

    def ids(self, req: TraceRequest, order: tuple[int, ...], aligned: bool) -> tuple[list[int], int]:
        plan = self.planner.plan(self.request(req, aligned), FixedOrder(tuple(order)))
        return plan.ids, plan.padding_tokens


def overhead_us(requests: list[TraceRequest], renderer: TraceRenderer, sequences: int, block_size: int,
                seed: int) -> list[float]:
    """Per-call ``Weaver.order`` time with ``sequences`` served sequences in the tree (one tenant)."""
    rng = random.Random(seed)
    weaver = Weaver(block_size=block_size, max_nodes=max(100_000, sequences * 12))
    lengths = [[len(t) for t in renderer.doc_tokens(r)] for r in requests]
    pool = [[Doc(id=d.id, tokens=n) for d, n in zip(r.documents, ls)] for r, ls in zip(requests, lengths)]
    for _ in range(sequences):  # served sequences: the stream's sets in shuffled orders
        docs = list(rng.choice(pool))
        rng.shuffle(docs)
        weaver.order(docs)
    samples = []
    for docs in pool * max(1, 2000 // len(pool)):
        t0 = time.perf_counter()
        weaver.order(docs)  # recording included: a server records every request it orders
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


def _policies(ctx: BenchContext) -> list[str]:
    """``--set policies=``, checked against ``POLICIES``."""
    policies = ctx.option("policies", ",".join(POLICIES)).split(",")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ConfigError(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    return policies


def _start_server(ctx: BenchContext, model_dir: Path, block: int, tick: Tick) -> VLLMServer:
    """A vLLM server of the bench's own (no ``--upstream``), started."""
    server = VLLMServer(VLLMServerConfig(model_dir=model_dir, block_size=block,
                                         log_file=ctx.config.cache_dir / "logs" / "bench-ordering-vllm.log"))
    (ctx.config.cache_dir / "logs").mkdir(parents=True, exist_ok=True)
    tick("starting vLLM")
    server.start()
    return server


def _check_tokenizer(client: CompletionClient, renderer: TraceRenderer, req: TraceRequest, upstream: str,
                     model: str) -> None:
    """The server must tokenize as the bench renders, or the token-id prompts mean something else there."""
    probe = renderer.doc_tokens(req)[0]
    text = renderer.tok.decode(probe)
    if client.tokenize(text)[: len(probe) // 2] != list(probe[: len(probe) // 2]):
        raise ConfigError(f"{upstream} tokenizes differently from {model}; pass --model for the served model")


def _choose_order(policy: str, weaver: Weaver, req: TraceRequest, docs: list[Doc], block: int):
    """(order, expected reusable tokens or None) of ``docs`` under ``policy``; the tree records it."""
    if policy == "retrieval":
        return tuple(range(len(docs))), None
    if policy == "oracle":
        tree = weaver.tree(req.tenant)
        order, expect = oracle(tree, docs, block)
        tree.insert((docs[i].id, docs[i].tokens) for i in order)
        return order, expect
    res = weaver.order(docs, req.tenant)
    return res.order, res.reusable_tokens


def _send(client: CompletionClient, renderer: TraceRenderer, weaver: Weaver, req: TraceRequest, *, policy: str,
          block: int, max_tokens: int, run_salt: str) -> dict:
    """One request under ``policy``: ordered (timed), rendered, sent; its record."""
    lengths = [len(t) for t in renderer.doc_tokens(req)]
    aligned = policy == "weaver+aligned"
    docs = [Doc(id=d.id, tokens=len(pad_to_block(range(n), block, 0)) if aligned else n)
            for d, n in zip(req.documents, lengths)]
    t0 = time.perf_counter()
    order, expect = _choose_order(policy, weaver, req, docs, block)
    over = (time.perf_counter() - t0) * 1e6
    ids, padding = renderer.ids(req, order, aligned)
    salt = (req.tenant + run_salt) if (req.tenant or run_salt) else None
    c = client.complete(ids, max_tokens=max_tokens, cache_salt=salt, stop=("\n",))
    return {"reordered": order != tuple(range(len(docs))), "ttft": c.ttft_ms, "cached": c.cached_tokens or 0,
            "prompt": c.prompt_tokens, "padding": padding, "overhead": over, "expect": expect,
            "answers": req.answers, "text": c.text}


def _policy_row(policy: str, rec: list[dict], before: dict, after: dict, isolated: bool) -> dict:
    """The table row of one policy's records (and the server's prefix-cache counters around them)."""
    qa = [r for r in rec if r["answers"]]
    hits = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    queries = after.get("vllm:prefix_cache_queries_total", 0) - before.get("vllm:prefix_cache_queries_total", 0)
    return {
        "policy": policy,
        **timing_stats("ttft_ms", [r["ttft"] for r in rec]),
        "cached_tokens_mean": round(statistics.mean(r["cached"] for r in rec), 1),
        "prompt_tokens_mean": round(statistics.mean(r["prompt"] for r in rec), 1),
        "cached_share": round(sum(r["cached"] for r in rec) / max(1, sum(r["prompt"] for r in rec)), 4),
        "server_hit_rate": round(hits / queries, 4) if queries else None,
        "reordered_share": round(statistics.mean(r["reordered"] for r in rec), 4),
        "padding_tokens_mean": round(statistics.mean(r["padding"] for r in rec), 1),
        "overhead_us_p50": round(percentile([r["overhead"] for r in rec], 50), 1),
        "answer_f1": round(100 * statistics.mean(answer_f1(r["text"], r["answers"]) for r in qa), 2) if qa else None,
        "answer_em": round(100 * statistics.mean(answer_em(r["text"], r["answers"]) for r in qa), 2) if qa else None,
        "requests": len(rec),
        "isolated_by": "reset_prefix_cache" if isolated else "cache_salt",
        "default": policy == "weaver",
    }  # fmt: skip


def _run_policy(client: CompletionClient, renderer: TraceRenderer, requests: list[TraceRequest], tick: Tick, *,
                upstream: str, policy: str, block: int, max_tokens: int) -> dict:
    """The whole stream under one policy, on an emptied (or freshly salted) prefix cache: its row."""
    isolated = reset_prefix_cache(upstream)
    run_salt = "" if isolated else f"-{policy.replace('+', '_')}-{uuid.uuid4().hex[:8]}"
    weaver = Weaver(block_size=block)
    before = client.metrics()
    rec = []
    for req in requests:
        rec.append(_send(client, renderer, weaver, req, policy=policy, block=block, max_tokens=max_tokens,
                         run_salt=run_salt))
        tick(f"{policy}: {len(rec)}/{len(requests)}")
    return _policy_row(policy, rec, before, client.metrics(), isolated)


def _summary(rows: list[dict], requests: list[TraceRequest], over: list[float]) -> dict:
    """Overhead, and weaver against retrieval order (and the oracle, and block alignment) where they ran."""
    by = {r["policy"]: r for r in rows}
    summary: dict = {"overhead_us_p50": round(percentile(over, 50), 1),
                     "overhead_us_p99": round(percentile(over, 99), 1),
                     "requests": len(requests), "qa_requests": sum(1 for r in requests if r.answers)}
    if "retrieval" in by and "weaver" in by:
        base, w = by["retrieval"], by["weaver"]
        summary["ttft_reduction_vs_retrieval"] = round(1 - w["ttft_ms_p50"] / base["ttft_ms_p50"], 4)
        if w["answer_f1"] is not None and base["answer_f1"] is not None:
            summary["answer_f1_delta"] = round(w["answer_f1"] - base["answer_f1"], 2)
        if "oracle" in by:
            o = by["oracle"]
            gain = o["cached_tokens_mean"] - base["cached_tokens_mean"]
            summary["share_of_oracle_gain"] = (
                round((w["cached_tokens_mean"] - base["cached_tokens_mean"]) / gain, 4) if gain > 0 else None
            )
            tgain = base["ttft_ms_p50"] - o["ttft_ms_p50"]
            summary["share_of_oracle_ttft_gain"] = (
                round((base["ttft_ms_p50"] - w["ttft_ms_p50"]) / tgain, 4) if tgain > 0 else None
            )
        if "weaver+aligned" in by:
            summary["aligned_ttft_vs_weaver"] = round(by["weaver+aligned"]["ttft_ms_p50"] / w["ttft_ms_p50"], 4)
    return summary


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    k = ctx.option("k", 10, int)
    block = ctx.option("block_size", 32, int)
    max_tokens = ctx.option("max_tokens", 24, int)
    policies = _policies(ctx)
    requests = load_stream(ctx, k)
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    renderer = TraceRenderer(Tokenizer(model_dir), block)
    upstream = ctx.option("upstream", "")
    server = None
    if not upstream:
        server = _start_server(ctx, model_dir, block, tick)
        upstream = server.url
    rows = []
    tick(total=len(policies) * len(requests))
    try:
        client = CompletionClient(upstream, served_model(upstream))
        _check_tokenizer(client, renderer, requests[0], upstream, ctx.config.model)
        for policy in policies:
            rows.append(_run_policy(client, renderer, requests, tick, upstream=upstream, policy=policy,
                                    block=block, max_tokens=max_tokens))
    finally:
        if server is not None:
            server.stop()
    over = overhead_us(requests, renderer, ctx.option("tree_sequences", 10_000, int), block, ctx.seed)
    summary = _summary(rows, requests, over)
    config = {"k": k, "block_size": block, "max_tokens": max_tokens, "policies": policies,
              "upstream": ctx.option("upstream", "") or "started by the bench",
              "trace": ctx.option("trace", None), "n": len(requests), "seed": ctx.seed}
    return BenchResult("ordering", config, rows, summary)


def plot(result: BenchResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["policy"] for r in result.rows]
    ax[0].bar(names, [r["ttft_ms_p50"] for r in result.rows])
    ax[0].set_ylabel("TTFT p50 (ms)")
    ax[1].bar(names, [r["cached_share"] for r in result.rows])
    ax[1].set_ylabel("prompt tokens served from cache")
    for a in ax:
        a.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
