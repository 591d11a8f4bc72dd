"""``contextkit bench reorder``: what serving documents in the prefix cache's order does to answers, and
whether a one-line relevance hint gives back what the reordering changed.

Reordering is exact KV (every token is computed in the prompt it is in) but a different prompt: the
retriever ranked the documents and the Weaver serves them in the order the tenant's cache holds. This
bench measures that change the way the span benches measure an approximation, over the whole answer
(``spans.fidelity``), on the built-in engine with full prefill only (nothing cached, no reuse):

- The documents trace (``bench ordering``'s generator on the ``--set split=`` half of the data, held-out
  by default on the shared file; or ``--trace FILE``) is replayed through one Weaver, as the proxy serves
  it. Each request the Weaver reorders (up to ``--n``) is prefilled four ways on the configured dtype:
  ``retrieval`` (the retriever's order: the reference), ``weaver`` (the served order),
  ``weaver + titles hint`` and ``weaver + positions hint`` (``ChatRequest.relevance_hint``: a line after
  the documents, before the question, naming the documents most relevant first), and once more in
  float32 in retrieval order (the floor the dtype alone sets).
- Per arm against the retrieval order's greedy answer (``decode_tokens``, 32): ``tf_agreement``, answer KL
  (p50/p90), ``gold_logprob_delta`` (the gold answer's mean log-probability per token minus retrieval
  order's: does the model still find the evidence?), ``answer_changed`` (the first 8 greedy tokens differ
  from retrieval order's: the measure the issue started from) and answer F1 / EM against the gold answers.

Summary: ``reordered_requests``, ``reorder_tf_agreement``, ``reorder_answer_kl_p50``/``_p90``,
``reorder_gold_logprob_delta``, ``reorder_answer_changed_share``; the same with ``hint_titles_`` and
``hint_positions_``; ``floor_tf_agreement`` (bf16 retrieval order vs float32). Options (``--set``): ``k`` (10),
``requests`` (trace length when generated, 240), ``decode_tokens`` (32), ``split`` (auto/tune/heldout/all),
``block_size`` (32: the Weaver's, vLLM's on CPU).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from contextkit.bench.answers import answered
from contextkit.bench.data import load_records, shared_half, split
from contextkit.bench.harness import BenchContext, BenchResult, Tick, percentile
from contextkit.bench.metrics import answer_em, answer_f1
from contextkit.bench.workload import TraceRequest, WorkloadSpec, generate, read_trace
from contextkit.core.errors import InputError
from contextkit.core.generation import SamplingParams
from contextkit.core.models import resolve_model_dir
from contextkit.core.planner import ChatRequest, FixedOrder, Planner
from contextkit.core.prompt import relevance_line
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Evidence, Message
from contextkit.engine.model import Engine
from contextkit.ordering.weaver import Weaver
from contextkit.spans.fidelity import MethodKV, gold_ids, score

REFERENCE = "retrieval"
FLOOR = "retrieval (float32)"
# arm -> (served in the Weaver's order, relevance_hint)
ARMS = {REFERENCE: (False, "none"), "weaver": (True, "none"),
        "weaver + titles hint": (True, "titles"), "weaver + positions hint": (True, "positions")}
CONTROL = "retrieval + titles line"  # the titles line in retrieval order: what the line does by itself
SUMMARY_PREFIX = {"weaver": "reorder", "weaver + titles hint": "hint_titles",
                  "weaver + positions hint": "hint_positions", CONTROL: "control_titles"}
CHANGED_TOKENS = 8  # the answer's first tokens compared for "changed"


def trace(ctx: BenchContext, k: int) -> tuple[list[TraceRequest], str]:
    """The replayed requests and which half of the data they come from."""
    given = ctx.option("trace", None)
    if given:
        return read_trace(Path(given)), "trace"
    from contextkit.bench.retrieval import Retriever, passage_pool

    part = ctx.option("split", "auto")
    if part == "auto":
        part = shared_half(ctx.data, "heldout")
    records = split(load_records(ctx.data), part)
    if not records:
        raise InputError(f"--set split={part} leaves no records of the data; use split=all")
    retriever = Retriever(passage_pool(records), ctx.config.cache_dir)
    spec = WorkloadSpec(requests=ctx.option("requests", 240, int), k=k, seed=ctx.seed)
    return generate(records, retriever, spec), part


def chat(req: TraceRequest, hint: str, max_new_tokens: int) -> ChatRequest:
    docs = tuple(Evidence(d.text, id=d.id, title=d.title or None) for d in req.documents)
    return ChatRequest((Message("user", req.question),), docs, relevance_hint=hint, max_new_tokens=max_new_tokens)


def reordered(requests: list[TraceRequest], planner: Planner, *, limit: int,
              block_size: int) -> list[tuple[TraceRequest, tuple[int, ...]]]:
    """The requests the Weaver serves in another order than retrieval's (up to ``limit``), each with that
    order; every request is recorded in the Weaver, as the proxy records what it serves."""
    weaver, out = Weaver(block_size), []
    for req in requests:
        docs = planner.docs(chat(req, "none", 1))
        order = weaver.order(docs, req.tenant or "default").order
        if order != tuple(range(len(docs))):
            out.append((req, order))
            if len(out) == limit:
                break
    return out


def with_line(planner: Planner, req: TraceRequest, ids: list[int], decode: int) -> list[int]:
    """Retrieval order's prompt ``ids`` with the titles line before the question anyway (the planner
    writes it only for a reordered request): the control that tells the line's own effect apart."""
    request = chat(req, "none", decode)
    tail = len(planner.frame(request)[2])
    line = planner.text_tokens(relevance_line(request.documents, tuple(range(len(request.documents))), "titles"))
    return [*ids[: len(ids) - tail], *line, *ids[len(ids) - tail:]]


def _prefill(engine: Engine, tok: Tokenizer, ids: list[int], decode: int) -> tuple[MethodKV, str]:
    cache = engine.new_cache(len(ids) + decode + 1)
    first = engine.forward(cache, ids, logits="last")
    kv, gen = answered(engine, tok, ids, cache, first, SamplingParams(max_new_tokens=decode))
    return kv, gen.text


def measure(req: TraceRequest, order: tuple[int, ...], planner: Planner, engines: dict[str, Engine],
            tok: Tokenizer, *, dtype: str, decode: int) -> dict[str, dict[str, Any]]:
    """Every arm of one reordered request: fidelity to retrieval order, gold delta, answer quality."""
    ids = {name: planner.plan(chat(req, hint, decode),
                              FixedOrder(order if served else tuple(range(len(order))))).ids
           for name, (served, hint) in ARMS.items()}
    ids[FLOOR] = ids[REFERENCE]  # the same prompt on the float32 engine
    ids[CONTROL] = with_line(planner, req, ids[REFERENCE], decode)
    kvs, texts = {}, {}
    for name, prompt in ids.items():
        kvs[name], texts[name] = _prefill(engines["float32" if name == FLOOR else dtype], tok, prompt, decode)
    whole = score(kvs, same_dtype=REFERENCE, fp32=FLOOR, gold=gold_ids(tok.encode, req.answers, decode))
    ref = kvs[REFERENCE].token_ids[:CHANGED_TOKENS]
    return {name: {**whole[name], "changed": float(kv.token_ids[:CHANGED_TOKENS] != ref),
                   "f1": answer_f1(texts[name], req.answers), "em": answer_em(texts[name], req.answers),
                   "prompt_tokens": len(ids[name])}
            for name, kv in kvs.items()}


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.mean(kept), 4) if kept else None


def row(name: str, measured: list[dict[str, Any]]) -> dict[str, Any]:
    kls = [m["answer_kl"] for m in measured]
    return {
        "arm": name, "requests": len(measured),
        "tf_agreement": _mean([m["tf_agreement"] for m in measured]),
        "answer_kl_p50": round(percentile(kls, 50), 4), "answer_kl_p90": round(percentile(kls, 90), 4),
        "gold_logprob_delta": _mean([m["gold_logprob_delta"] for m in measured]),
        "answer_changed_share": _mean([m["changed"] for m in measured]),
        "answer_f1": _mean([m["f1"] for m in measured]), "answer_em": _mean([m["em"] for m in measured]),
        "tf_agreement_fp32": _mean([m["tf_agreement_fp32"] for m in measured]),
        "prompt_tokens_p50": statistics.median(m["prompt_tokens"] for m in measured),
    }


def summary(rows: dict[str, dict[str, Any]], *, n_trace: int, part: str, with_gold: int) -> dict[str, Any]:
    """The headline keys; the gold keys are None when no reordered request has a gold answer."""
    out: dict[str, Any] = {"trace_requests": n_trace, "split": part,
                           "reordered_requests": rows[REFERENCE]["requests"], "requests_with_gold": with_gold}
    for name, prefix in SUMMARY_PREFIX.items():
        r = rows[name]
        for key in ("tf_agreement", "answer_kl_p50", "answer_kl_p90", "gold_logprob_delta", "answer_changed_share",
                    "answer_f1"):
            out[f"{prefix}_{key}"] = r[key]
    out["retrieval_answer_f1"] = rows[REFERENCE]["answer_f1"]
    out["floor_tf_agreement"] = rows[FLOOR]["tf_agreement"]  # bf16 retrieval order against float32's answer
    out["floor_answer_kl_p90"] = rows[FLOOR]["answer_kl_p90"]
    return out


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    k, decode = ctx.option("k", 10, int), ctx.option("decode_tokens", 32, int)
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    tok, dtype = Tokenizer(model_dir), ctx.config.dtype
    engines = {dt: Engine.from_dir(model_dir, dt) for dt in {"float32", dtype}}
    planner = Planner(tok, context_limit=min(e.spec.max_positions for e in engines.values()))
    requests, part = trace(ctx, k)
    chosen = reordered(requests, planner, limit=ctx.count(40), block_size=ctx.option("block_size", 32, int))
    if not chosen:
        raise InputError(f"the Weaver reordered none of the {len(requests)} requests; replay a longer trace "
                         "(--set requests=) or one whose sessions share documents")
    tick(total=len(chosen))
    per: dict[str, list[dict[str, Any]]] = {name: [] for name in (*ARMS, CONTROL, FLOOR)}
    for i, (req, order) in enumerate(chosen):
        tick(f"request {i}")
        for name, measured in measure(req, order, planner, engines, tok, dtype=dtype, decode=decode).items():
            per[name].append(measured)
    rows = {name: row(name, measured) for name, measured in per.items()}
    config = {"model": ctx.config.model, "dtype": dtype, "k": k, "decode_tokens": decode, "seed": ctx.seed}
    return BenchResult("reorder", config, list(rows.values()), summary(
        rows, n_trace=len(requests), part=part,
        with_gold=sum(1 for req, _ in chosen if any(a.strip() for a in req.answers))))


def plot(result: BenchResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if r["arm"] != REFERENCE]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["arm"] for r in rows], [r["tf_agreement"] for r in rows])
    ax.set(xlabel="teacher-forced agreement with the retrieval order's answer", xlim=(0, 1))
    fig.tight_layout()
    fig.savefig(path)
