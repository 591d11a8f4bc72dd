"""``contextkit bench synthesis [--data FILE]``: a synthesizer reading parallel workers' KV vs their text.

Per multi-hop question (the dev file, or ``--data``; ``--n`` questions, default 24, drawn with the
seed): three workers (``--set workers=3``) share a prefix (instructions and the question) and each reads
its share of the passages (round robin) and writes a note (greedy, ``--set note_tokens=48``), all in one
fork (``synthesis.parallel``). The synthesizer's context is its head (instructions, question), each
note under a label, and the instruction to answer. Compared in the same run, on the same notes:

- ``text``: the notes' text in the synthesizer's prompt, prefilled in full (what frameworks do today);
- ``kv ...``: the notes' KV from the workers' branches, re-positioned, with each recompute policy
  (``join``); the default policy's row is marked.

TTFT is the wall time from the notes to the synthesizer's first-token logits (assembly, recompute and
prefill; the head is computed by both). Answers: 24 greedy tokens; ``answer_f1`` (SQuAD F1 against the
gold answers, points) and ``answer_agreement_f1`` (token F1 against the text synthesizer's answer).

Summary: ``ttft_speedup_vs_text``, ``answer_f1_delta`` (KV minus text, F1 points, default policy),
``answer_agreement_f1``, ``top1_agreement``, ``kl_p50``, worker time and note length; ``tf_agreement``,
``answer_kl_p90`` and ``gold_logprob_delta``: the whole answer teacher-forced against the text synthesizer on
the same engine, and the gold answer's log-likelihood per token, KV minus text (``spans.fidelity``).

``--set paths=local,http`` (the default: both): ``http`` runs the same questions as chats to
``contextkit serve`` (workers that keep their KV, a synthesizer that names their handles;
``bench/synthesis_http.py``), each against its own text re-prefill on the same server: rows with
``path: http`` and summary keys ``http_join_speedup_vs_text``, ``http_join_tf_agreement``,
``http_join_answer_kl_p90``, ``http_join_gold_logprob_delta`` (the first read; each read's with its name:
``http_transcripts_join_...``), ``http_kv_share`` (handles read from KV) and
``http_keep_overhead_vs_worker_ttft`` (the server's keep time per worker over the worker's TTFT).
"""

from __future__ import annotations

import contextlib
import time

from contextkit.bench.answers import answered
from contextkit.bench.data import load_records, sample, split
from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.bench.metrics import answer_f1, kl_divergence, token_f1
from contextkit.core.errors import InputError
from contextkit.core.generation import SamplingParams
from contextkit.core.policy import ReuseOptions
from contextkit.core.prompt import render_document
from contextkit.spans.fidelity import gold_ids, score

WORKER = ("You are a research worker on a team. Read your passages and write one short note with the facts "
          "they give about the question. If they say nothing about it, write: nothing relevant.\n"
          "Question: {question}\n\n")
SYNTH = ("You combine the notes of three research workers into one answer.\nQuestion: {question}\n")
TAIL = "\n\nAnswer the question in a few words, from the notes.\nAnswer:"


READS = ("notes", "transcripts")
DEFAULT = f"kv default (budget {ReuseOptions().budget})"


def methods() -> dict[str, ReuseOptions]:
    return {
        "kv reuse": ReuseOptions(policy="none", first_k=0),
        "kv query_attention r=0.05": ReuseOptions(policy="query_attention", ratio=0.05, max_recompute=None),
        "kv query_attention r=0.1": ReuseOptions(policy="query_attention", ratio=0.1, max_recompute=None),
        "kv query_attention r=0.2": ReuseOptions(policy="query_attention", ratio=0.2, max_recompute=None),
        DEFAULT: ReuseOptions(),
    }


def _choices(ctx: BenchContext, key: str, allowed: tuple[str, ...], default: str) -> list[str]:
    """``--set KEY=a,b``: a comma-separated choice among ``allowed`` (a clear error otherwise)."""
    chosen = [r.strip() for r in ctx.option(key, default, str).split(",")]
    if not chosen or any(r not in allowed for r in chosen):
        raise InputError(f"--set {key}= takes {' and/or '.join(allowed)} (comma-separated), "
                         f"got {ctx.option(key, '', str)!r}")
    return chosen


def _reads(ctx: BenchContext) -> list[str]:
    """``--set read=``: what the synthesizer reads of the workers (their notes, or whole transcripts)."""
    return _choices(ctx, "read", READS, "notes,transcripts")


def _workers(kit, rec, workers: int, note_tokens: int):
    """The workers' fork on one question: (the fork, its wall time in ms, how many workers got passages)."""
    from contextkit.synthesis.parallel import fork

    tok = kit.tokenizer
    prefix = tok.encode(WORKER.format(question=rec.question), add_special_tokens=True)
    shares = [rec.passages[w::workers] for w in range(workers)]
    prompts = [tok.encode("".join(render_document(p) for p in share) + "Note:") for share in shares if share]
    t0 = time.perf_counter()
    f = fork(kit.spans, tok, prefix, prompts, SamplingParams(max_new_tokens=note_tokens))
    return f, (time.perf_counter() - t0) * 1e3, len(prompts)


def _synthesize(kit, f, head, tail, labels, table: dict[str, ReuseOptions], *, qi: int, read: str,
                answer_tokens: int, tick: Tick) -> dict[str, tuple]:
    """The synthesizer on one fork, every method (and "text") in a rotating order: name -> (logits, answer,
    ttft ms, report)."""
    from contextkit.synthesis.parallel import join, join_text

    transcripts = read == "transcripts"
    params = SamplingParams(max_new_tokens=answer_tokens)
    out = {}
    names = ["text", *table]
    for name in names[qi % len(names):] + names[: qi % len(names)]:
        tick(f"{read}: {name} q{qi}")
        t0 = time.perf_counter()
        if name == "text":
            asm, _, plan = join_text(f, head, tail, labels, answer_tokens + 1, transcripts)
        else:
            asm, _, plan = join(f, head, tail, labels, table[name], answer_tokens + 1, transcripts)
        ttft = (time.perf_counter() - t0) * 1e3
        kv, gen = answered(kit.engine, kit.tokenizer, plan.ids, asm.cache, asm.logits, params)  # scored in _record
        out[name] = (asm.logits[0], gen.text, ttft, asm.report, kv)
    return out


def _record(per: dict[tuple[str, str], dict[str, list[float]]], read: str, out: dict[str, tuple], rec,
            gold: list[int] | None) -> None:
    """Append one question's measurements per method, against the text synthesizer's (same engine)."""
    ref_logits, ref_text, _, _, _ = out["text"]
    whole = score({name: o[4] for name, o in out.items()}, same_dtype="text", fp32=None, gold=gold)
    for name, (logits, text, ttft, report, _) in out.items():
        m = per[(read, name)]
        m.setdefault("ttft", []).append(ttft)
        m.setdefault("f1", []).append(answer_f1(text, rec.answers))
        m.setdefault("agree", []).append(token_f1(text, ref_text))
        m.setdefault("kl", []).append(kl_divergence(ref_logits, logits))
        m.setdefault("top1", []).append(float(int(logits.argmax()) == int(ref_logits.argmax())))
        m.setdefault("tf", []).append(whole[name]["tf_agreement"])
        m.setdefault("answer_kl", []).append(whole[name]["answer_kl"])
        if whole[name]["gold_logprob_delta"] is not None:
            m.setdefault("gold", []).append(whole[name]["gold_logprob_delta"])
        m.setdefault("context", []).append(report.context_tokens)
        m.setdefault("recomputed", []).append(report.recomputed_tokens)


def _rows(per: dict[tuple[str, str], dict[str, list[float]]], reads: list[str]) -> list[dict]:
    rows = []
    for (read, name), m in per.items():
        text_ttft = median(per[(read, "text")]["ttft"])
        rows.append({
            "read": read, "method": name, "questions": len(m["ttft"]),
            "ttft_ms_p50": round(median(m["ttft"]), 1), "ttft_ms_p90": round(percentile(m["ttft"], 90), 1),
            "ttft_speedup_vs_text": round(text_ttft / median(m["ttft"]), 2),
            "answer_f1": round(100 * sum(m["f1"]) / len(m["f1"]), 2),
            "answer_agreement_f1": round(sum(m["agree"]) / len(m["agree"]), 3),
            "top1_agreement": round(sum(m["top1"]) / len(m["top1"]), 3), "kl_p50": round(median(m["kl"]), 4),
            "tf_agreement": round(sum(m["tf"]) / len(m["tf"]), 3),
            "answer_kl_p50": round(median(m["answer_kl"]), 4),
            "answer_kl_p90": round(percentile(m["answer_kl"], 90), 4),
            "gold_logprob_delta": round(sum(m["gold"]) / len(m["gold"]), 4) if m.get("gold") else None,
            "context_tokens_p50": median(m["context"]), "recomputed_tokens_p50": median(m["recomputed"]),
            "path": "local", "default": name == DEFAULT and read == reads[0],
        })
    return rows


def _summary(rows: list[dict], reads: list[str], questions: int, worker_ms: list[float], note_len: list[int]) -> dict:
    by = {(r["read"], r["method"]): r for r in rows}
    summary = {"questions": questions, "default_method": DEFAULT, "default_read": reads[0],
               "workers_ms_p50": round(median(worker_ms), 1), "note_tokens_p50": median(note_len)}
    for read in reads:  # the first read's keys bare, every read's with its name as a prefix
        d, t = by[(read, DEFAULT)], by[(read, "text")]
        keys = {
            "ttft_speedup_vs_text": d["ttft_speedup_vs_text"],
            "answer_f1_delta": round(d["answer_f1"] - t["answer_f1"], 2),
            "answer_agreement_f1": d["answer_agreement_f1"],
            "top1_agreement": d["top1_agreement"], "kl_p50": d["kl_p50"],
            "tf_agreement": d["tf_agreement"], "answer_kl_p90": d["answer_kl_p90"],
            "gold_logprob_delta": d["gold_logprob_delta"],
            "text_ttft_ms_p50": t["ttft_ms_p50"], "context_tokens_p50": d["context_tokens_p50"],
        }
        if read == reads[0]:
            summary.update(keys)
        summary.update({f"{read}_{k}": v for k, v in keys.items()})
    return summary


PATHS = ("local", "http")


def _paths(ctx: BenchContext) -> list[str]:
    """``--set paths=``: in process (the fork's KV), over HTTP to serve (kept answers), or both."""
    return _choices(ctx, "paths", PATHS, "local,http")


def _http_rows(run, reads: list[str]) -> list[dict]:
    rows = []
    for (read, name), m in run.per.items():
        text_ttft = median(run.per[(read, "text")]["ttft"])
        rows.append({
            "path": "http", "read": read, "method": name, "questions": len(m["ttft"]),
            "ttft_ms_p50": round(median(m["ttft"]), 1), "ttft_speedup_vs_text": round(text_ttft / median(m["ttft"]), 2),
            "tf_agreement": round(sum(m["tf_agreement"]) / len(m["tf_agreement"]), 3),
            "answer_kl_p90": round(percentile(m["answer_kl"], 90), 4),
            "gold_logprob_delta": round(sum(m["gold"]) / len(m["gold"]), 4) if m.get("gold") else None,
            "escalated_share": round(sum(m["escalated"]) / len(m["escalated"]), 3),
            "context_tokens_p50": median(m["context"]), "recomputed_tokens_p50": median(m["recomputed"]),
            "default": name == "kv default" and read == reads[0],
        })
    return rows


def _http_summary(rows: list[dict], run, reads: list[str]) -> dict:
    by = {(r["read"], r["method"]): r for r in rows}
    out = {}
    for read in reads:
        d = by.get((read, "kv default"))
        if d is None:
            continue
        keys = {"join_speedup_vs_text": d["ttft_speedup_vs_text"], "join_tf_agreement": d["tf_agreement"],
                "join_answer_kl_p90": d["answer_kl_p90"], "join_gold_logprob_delta": d["gold_logprob_delta"]}
        if read == reads[0]:
            out.update({f"http_{k}": v for k, v in keys.items()})
        out.update({f"http_{read}_{k}": v for k, v in keys.items()})
    named = sum(run.reads.values())
    out["http_escalated_share"] = by[(reads[0], "kv default")]["escalated_share"] if (reads[0], "kv default") in by \
        else None
    out["http_kv_share"] = round(run.reads.get("kv", 0) / named, 3) if named else None
    out["http_handle_reads"] = dict(run.reads)
    if run.keep_ms:
        out["http_keep_ms_p50"] = round(median(run.keep_ms), 2)
        out["http_keep_overhead_vs_worker_ttft"] = round(median(run.keep_ms) / median(run.worker_ttft), 4)
    return out


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    from contextkit.bench.synthesis_http import HTTPPath
    from contextkit.kit import ContextKit

    workers, note_tokens = ctx.option("workers", 3, int), ctx.option("note_tokens", 48, int)
    answer_tokens = ctx.option("answer_tokens", 24, int)
    reads, paths = _reads(ctx), _paths(ctx)
    part = ctx.option("split", "all", str)
    records = sample(split(load_records(ctx.data), part), ctx.count(24), ctx.seed)
    table = methods()
    kit = ContextKit(ctx.config)
    tok = kit.tokenizer
    # (read, method) -> metric -> values
    per: dict[tuple[str, str], dict[str, list[float]]] = {(r, m): {} for r in reads for m in ("text", *table)}
    worker_ms, note_len = [], []
    local = "local" in paths
    tick(total=len(records) * ((len(reads) * (len(table) + 1) + 1) * local + (len(reads) * 2 + 1) * ("http" in paths)))
    http = HTTPPath(kit, note_tokens=note_tokens, answer_tokens=answer_tokens, workers=workers)
    try:
        with http if "http" in paths else contextlib.nullcontext():
            for qi, rec in enumerate(records):
                gold = gold_ids(tok.encode, rec.answers, answer_tokens)
                if local:
                    _local_question(kit, rec, qi, per, worker_ms, note_len, table, reads, gold, tick,
                                    workers=workers, note_tokens=note_tokens, answer_tokens=answer_tokens)
                if "http" in paths:
                    http.question(qi=qi, worker=WORKER.format(question=rec.question),
                                  synth=SYNTH.format(question=rec.question), tail=TAIL, passages=list(rec.passages),
                                  reads=reads, gold=gold, tick=tick)
    finally:
        kit.close()
    rows = _rows(per, reads) if local else []
    summary = _summary(rows, reads, len(records), worker_ms, note_len) if local else {"questions": len(records)}
    if "http" in paths:
        http_rows = _http_rows(http.run, reads)
        rows += http_rows
        summary.update(_http_summary(http_rows, http.run, reads))
    config = {"model": ctx.config.model, "dtype": ctx.config.dtype, "data": str(ctx.data) if ctx.data else "default",
              "n": len(records),
              "seed": ctx.seed, "workers": workers, "note_tokens": note_tokens, "answer_tokens": answer_tokens,
              "read": reads, "split": part, "paths": paths}
    return BenchResult("synthesis", config, rows, summary)


def _local_question(kit, rec, qi, per, worker_ms, note_len, table, reads, gold, tick, *, workers, note_tokens,
                    answer_tokens) -> None:
    """The in-process path on one question: the fork, then every method's join per read."""
    tok = kit.tokenizer
    tick(f"workers q{qi}")
    f, ms, notes = _workers(kit, rec, workers, note_tokens)
    worker_ms.append(ms)
    note_len.extend(len(b.token_ids) for b in f.branches)
    head = tok.encode(SYNTH.format(question=rec.question), add_special_tokens=True)
    labels = [tok.encode(f"\nNote {i + 1}:") for i in range(notes)]
    tail = tok.encode(TAIL)
    for read in reads:
        out = _synthesize(kit, f, head, tail, labels, table, qi=qi, read=read, answer_tokens=answer_tokens,
                          tick=tick)
        _record(per, read, out, rec, gold)
