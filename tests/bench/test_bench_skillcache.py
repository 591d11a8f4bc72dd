"""``contextkit bench skillcache``: the Zipf skill-set workload, the prefix-cache model it is checked
against, and a small run end to end through the proxy in front of the session's real vLLM."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from contextkit.bench.skillcache import CANONICAL, REQUEST_ORDER, ideal_cached, workload
from contextkit.core.types import Skill


def _skill(i: int) -> Skill:
    return Skill(f"skill-{i:02d}", f"Step {i}: do the thing numbered {i} before anything else.\n" * 8)


def test_workload_draws_popular_sets_in_random_orders():
    skills = [_skill(i) for i in range(10)]
    reqs = workload(skills, ["q1", "q2"], 400, 1.1, 3, seed=3)
    assert reqs == workload(skills, ["q1", "q2"], 400, 1.1, 3, seed=3)  # seeded
    assert reqs != workload(skills, ["q1", "q2"], 400, 1.1, 3, seed=4)
    assert all(1 <= len(r.skills) <= 3 and len({s.name for s in r.skills}) == len(r.skills) for r in reqs)
    assert [r.question for r in reqs[:3]] == ["q1", "q2", "q1"]
    uses = Counter(s.name for r in reqs for s in r.skills).most_common()
    assert uses[0][1] > 3 * uses[-1][1]  # Zipf: the most popular skill is drawn far more than the least
    assert uses[0][0] != "skill-00"  # popularity is a seeded shuffle, not the names' order
    listed = Counter(r.skills[0].name < r.skills[1].name for r in reqs if len(r.skills) > 1)
    assert min(listed.values()) > 0.3 * sum(listed.values())  # listed in random orders, not sorted


def test_ideal_prefix_cache_follows_vllms_rules():
    a, b = tuple(range(100)), tuple(range(64)) + (999,) * 40
    assert ideal_cached([a, a], 32) == [0, 96]  # whole blocks only (3 of 100 tokens' blocks)
    assert ideal_cached([a[:64], a[:64]], 32) == [0, 32]  # never the prompt's last token
    assert ideal_cached([a, b], 32) == [0, 64]  # the shared prefix's whole blocks
    assert ideal_cached([b[32:], b], 32) == [0, 0]  # a chained hash: the same block elsewhere is a miss


@pytest.mark.slow
def test_bench_skillcache_small_run(tmp_path, vllm_url, cli, shared_data):
    folder = shared_data / "skills"
    if not folder.is_dir():  # a clone without ../shared: a few skills written here
        folder = tmp_path / "skills"
        for i, topic in enumerate(("release notes", "changelogs", "code review", "migrations", "on-call",
                                   "incident reports")):
            name = topic.replace(" ", "-")
            (folder / name).mkdir(parents=True)
            body = "".join(f"{j}. For {topic}, check item {j} and write down what you found.\n" for j in range(12))
            (folder / name / "SKILL.md").write_text(f"---\nname: {name}\ndescription: How to do {topic}.\n---\n{body}")
    out = tmp_path / "skillcache.json"
    proc = cli("bench", "skillcache", "--upstream", vllm_url, "--skills", str(folder), "--n", "12", "--seed", "1",
               "--json", str(out), "--set", "max_tokens=200", "--set", "zipf=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {"bench", "config", "rows", "summary"} and result["bench"] == "skillcache"
    s = result["summary"]
    for key in ("skill_hit_rate", "skill_hit_rate_request_order", "cached_share", "cached_share_request_order",
                "ttft_ms_p50", "ttft_ms_p50_request_order", "ttft_vs_request_order", "distinct_skill_sets"):
        assert s[key] is not None, key
    assert s["requests"] == 12 and s["errors"] == 0
    assert s["render_mismatches"] == 0  # the proxy rendered what the bench's planner rendered, skills sorted
    rows = {r["arm"]: r for r in result["rows"]}
    assert list(rows) == [CANONICAL, REQUEST_ORDER] and rows[CANONICAL]["default"]
    a, b = rows[CANONICAL], rows[REQUEST_ORDER]
    assert a["requests"] == b["requests"] == 12 and a["skill_tokens"] == b["skill_tokens"]  # same blocks
    assert a["prompt_tokens"] == b["prompt_tokens"]  # only the order differs
    # vLLM served exactly what a prefix cache of 32-token blocks serves (salts fresh, nothing evicted)
    for row in (a, b):
        assert row["skill_hit_rate"] == row["ideal_skill_hit_rate"], row
    # the design's guarantee: a set seen before hits its whole skills block in the canonical order,
    # whatever order it was listed in; in request order only where the listing repeats
    assert a["repeat_skill_tokens"] > 0
    assert a["repeat_skill_hit_rate"] >= max(0.8, b["repeat_skill_hit_rate"])
    assert s["ttft_vs_request_order"] == round(s["ttft_ms_p50"] / s["ttft_ms_p50_request_order"], 4)
