"""``contextkit bench reorder`` end to end on a tiny trace: the requests the Weaver reorders, each prefilled
in retrieval order (the reference), the served order, with each relevance hint, the control line and the
float32 floor, scored over the whole answer."""

from __future__ import annotations

import json

import pytest

from contextkit.bench.workload import write_trace

pytestmark = pytest.mark.slow


def test_bench_reorder_small_run(tmp_path, cli, trace_requests):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "reorder.json"
    requests = trace_requests(2)  # per item: its passages, then the same set in another order
    write_trace(requests, trace)
    proc = cli("bench", "reorder", "--trace", str(trace), "--json", str(out), "--set", "decode_tokens=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["arm"]: r for r in result["rows"]}
    assert set(rows) == {"retrieval", "weaver", "weaver + titles hint", "weaver + positions hint",
                         "retrieval + titles line", "retrieval (float32)"}
    s = result["summary"]
    # the Weaver serves each second request in the order its first one left in the tree
    assert s["reordered_requests"] == 2 and s["trace_requests"] == len(requests)
    ref = rows["retrieval"]  # against itself: the same logits (its agreement can miss a near-tie: the
    # greedy answer is decoded a token at a time, teacher forcing runs it in one bf16 forward)
    assert ref["answer_kl_p90"] < 1e-6 and ref["answer_changed_share"] == 0 and ref["gold_logprob_delta"] is None
    # reordering moves tokens, it adds none; a hint line adds some, only after the documents
    assert (rows["weaver"]["prompt_tokens_p50"] == ref["prompt_tokens_p50"]
            == rows["retrieval (float32)"]["prompt_tokens_p50"])
    for arm in ("weaver + titles hint", "weaver + positions hint", "retrieval + titles line"):
        assert rows[arm]["prompt_tokens_p50"] > ref["prompt_tokens_p50"]
    for arm in rows.values():
        assert 0 <= arm["tf_agreement"] <= 1 and arm["answer_kl_p50"] >= 0
    # the reordered requests carry no gold answer: the gold metric is skipped and says so
    assert s["requests_with_gold"] == 0 and s["reorder_gold_logprob_delta"] is None
    for key in ("reorder_tf_agreement", "reorder_answer_kl_p90", "hint_titles_tf_agreement",
                "hint_positions_tf_agreement", "control_titles_tf_agreement", "floor_tf_agreement"):
        assert s[key] is not None, key
