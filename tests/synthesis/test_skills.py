"""The skill library on the real skills folder and the real model: registering and versions, retrieval
by meaning, the canonical block on the prompt path, splicing on the KV path (exact at r=1), errata."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from contextkit import ContextKit
from contextkit.core.errors import ConfigError
from contextkit.core.plan import RequestPlan
from contextkit.core.planner import ChatRequest, Planner
from contextkit.core.policy import ReuseOptions
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Evidence, Message, Skill
from contextkit.synthesis.skills import ErrataRule, SkillError, SkillLibrary, parse_skill

TOL = 1e-3
BODY = "# Resize tool\n\nUse `resize --size 128x128` to make thumbnails. Keep the aspect ratio.\n"


def _skill_md(name: str, body: str = BODY, description: str = "Make thumbnails with the resize tool.") -> str:
    return f"---\nname: {name}\ndescription: {description}\n---\n\n{body}"


@pytest.fixture(scope="module")
def skills_dir(shared_data) -> Path:
    d = shared_data / "skills"
    if not (d / "skills_index.jsonl").is_file():
        pytest.skip("the shared skills folder is not on this machine")
    return d


@pytest.fixture(scope="module")
def planner(smol_dir) -> Planner:
    return Planner(Tokenizer(smol_dir))


def test_registers_the_shared_folder_with_references(planner, skills_dir):
    lib = SkillLibrary(planner)
    skills = lib.register(skills_dir)
    assert len(skills) == 20 and len(set(s.version for s in skills)) == 20
    assert all(s.description and s.text and not s.text.startswith("---") for s in skills)
    assert len(lib.file("claude-api").references) > 10  # from skills_index.jsonl
    assert lib.register(skills_dir) == skills  # the same content: the same versions, nothing added
    assert all(len(lib.versions(n)) == 1 for n in lib.names)


def test_bad_folders_register_nothing(planner, tmp_path):
    lib = SkillLibrary(planner)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "SKILL.md").write_text(_skill_md("resize"))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "SKILL.md").write_text(_skill_md("resize", BODY + "More.\n"))
    with pytest.raises(SkillError, match="defined twice with different content"):
        lib.register(tmp_path)
    assert lib.names == []  # all or nothing
    for text, words in [("no front matter", "no front matter"), ("---\nname: [x\n---\nbody", "not valid YAML"),
                        ("---\nname: x\n---\nbody", "'description'"), (_skill_md("x", ""), "no body"),
                        ("---\nname: x\ndescription: y\nbody", "no closing")]:
        with pytest.raises(SkillError, match=words):
            parse_skill(text, "t/SKILL.md")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SkillError, match="no SKILL.md"):
        lib.register(tmp_path / "empty")
    with pytest.raises(SkillError, match="does not exist"):
        lib.register(tmp_path / "missing")


def test_a_changed_skill_is_a_new_version_and_the_old_one_stays_while_held(planner):
    lib = SkillLibrary(planner)
    v1 = lib.add("resize", BODY)
    with lib.hold(v1):
        v2 = lib.add("resize", BODY.replace("128x128", "64x64"))
        assert v2.version != v1.version and lib.get("resize") == v2
        assert lib.get("resize", v1.version) == v1  # a plan still uses it
    assert lib.versions("resize") == [v2]  # released: dropped
    with pytest.raises(SkillError, match="no version"):
        lib.get("resize", v1.version)
    with pytest.raises(SkillError, match="no skill named 'nope'"):
        lib.get("nope")


def test_skills_render_in_one_canonical_order_after_the_system_prompt(planner):
    a, b = Skill("alpha", "Do A.", "1"), Skill("beta", "Do B.", "2")
    docs = [Evidence("Some document.")]
    p1 = planner.plan(ChatRequest.ask("Q?", docs, skills=(b, a)))
    p2 = planner.plan(ChatRequest.ask("Another question?", docs, skills=(a, b)))
    kinds = [it.span.kind for it in p1.items]
    assert kinds == ["system", "skill", "skill", "system", "document", "query"]
    assert [it.span.name for it in p1.items[1:3]] == ["alpha@1", "beta@2"]
    n = sum(len(it.span.token_ids) for it in p1.items[:4])
    assert p1.ids[:n] == p2.ids[:n]  # the same skill set: the same prefix, whatever the request's order
    text = planner.tokenizer.decode(p1.ids)
    assert text.index("helpful assistant") < text.index("Skill: alpha") < text.index("Skill: beta") < text.index("Q?")
    # without documents the skills still follow the system prompt; the rest is the query
    p3 = planner.plan(ChatRequest.ask("Q?", skills=(a,), system="Be brief."))
    assert [it.span.kind for it in p3.items] == ["system", "skill", "query"]
    with pytest.raises(Exception, match="named twice"):
        ChatRequest.ask("Q?", skills=(a, a))


def test_retrieves_the_skill_a_task_needs(planner, skills_dir):
    lib = SkillLibrary(planner)
    lib.register(skills_dir)
    tasks = {"Make an animated GIF for a Slack message, small enough to upload": "slack-gif-creator",
             "Generate flow-field art in p5.js with a seeded random number generator": "algorithmic-art",
             "Write failing unit tests first, then the code that makes them pass": "test-driven-development"}
    for task, want in tasks.items():
        got = lib.retrieve(task, k=3)
        assert got[0][0].name == want, (task, [(s.name, round(x, 3)) for s, x in got])
        assert got[0][1] >= got[1][1] >= got[2][1]


def test_errata_until_the_rule_says_recompile(planner):
    lib = SkillLibrary(planner, rule=ErrataRule(max_errata=2, max_edit_share=0.05))
    v1 = lib.add("resize", BODY + "Check the output before you send it.\n" * 30)
    e1 = lib.edit("resize", "128x128", "96x96")
    assert e1.mode == "erratum" and e1.skill.version == v1.version and e1.skill.errata == (("128x128", "96x96"),)
    plan = planner.plan(ChatRequest.ask("How big are thumbnails?", skills=(e1.skill,)))
    assert [(it.span.kind, it.reuse) for it in plan.items][1:3] == [("skill", True), ("skill", False)]
    assert plan.items[1].span.token_ids == planner.skill_tokens(v1)  # the compiled KV stays valid
    assert '"128x128" is now "96x96"' in planner.tokenizer.decode(list(plan.items[2].span.token_ids))
    e2 = lib.edit("resize", "96x96", "80x80")  # edits the edited text
    assert e2.mode == "erratum" and len(e2.skill.errata) == 2
    e3 = lib.edit("resize", "aspect ratio", "proportions")
    assert e3.mode == "recompile" and "3 errata" in e3.reason and not e3.skill.errata
    assert "80x80" in e3.skill.text and "128x128" not in e3.skill.text and "proportions" in e3.skill.text
    big = lib.edit("resize", "Check the output before you send it.\n" * 3, "Send it.\n")
    assert big.mode == "recompile" and "replaces" in big.reason
    with pytest.raises(SkillError, match="does not contain"):
        lib.edit("resize", "no such field", "x")


@pytest.fixture
def fresh_kit(config, skills_dir):
    """A kit with an empty span cache and the shared skills registered in its library."""
    with ContextKit(config) as kit:
        lib = SkillLibrary(kit.planner, kit.spans)
        lib.register(skills_dir)
        yield kit, lib


@pytest.mark.slow
def test_spliced_skill_kv_is_compiled_once_and_exact_at_r1(fresh_kit):
    kit, lib = fresh_kit
    skill = lib.get("brand-guidelines")
    assert lib.compile(skill) is False and lib.compile(skill) is True  # once
    req = ChatRequest.ask("Which colors should a slide use?", skills=(skill,), system="Answer briefly.",
                          reuse=ReuseOptions(policy="query_attention", ratio=1.0, max_recompute=None))
    plan = kit.planner.plan(req)
    full = kit.spans.assemble(RequestPlan(plan.items, ReuseOptions(policy="full")))
    got = kit.spans.assemble(plan)  # first time at its canonical place: re-positioned, recomputed
    assert got.report.hits >= 1 and got.report.compiled_tokens <= len(plan.items[0].span.token_ids)
    assert (got.logits - full.logits).abs().max().item() <= TOL
    assert kit.spans.compile_pending() >= 1  # its place computed off the request path (anchored) ...
    again = kit.spans.assemble(plan)  # ... and from then on an exact prefix: nothing recomputed
    assert again.report.exact_tokens >= len(lib.tokens(skill)) and again.report.recomputed_tokens == 0
    assert (again.logits - full.logits).abs().max().item() <= TOL
    other = kit.planner.plan(dataclasses.replace(req, messages=(Message("system", "Be terse."), req.messages[-1])))
    moved = kit.spans.assemble(other)  # another system prompt: the position-free KV, re-positioned
    assert moved.report.hits >= 1 and moved.report.rerotated_tokens >= len(lib.tokens(skill))
    cheap = kit.spans.assemble(RequestPlan(plan.items, ReuseOptions(policy="none", first_k=0)))
    assert cheap.report.recomputed_tokens == 0 and cheap.report.reused_tokens >= len(lib.tokens(skill))
    # mid-conversation: the skill's items spliced into a hand-made plan after a document
    doc = kit.planner.plan(ChatRequest.ask("Q?", [Evidence("A memo about the launch.")]))
    items = (*doc.items[:-1], *lib.items(skill), doc.items[-1])
    mid = kit.spans.assemble(RequestPlan(items, ReuseOptions(policy="query_attention", ratio=1.0, max_recompute=None)))
    ref = kit.spans.assemble(RequestPlan(items, ReuseOptions(policy="full")))
    assert (mid.logits - ref.logits).abs().max().item() <= TOL
    assert torch.isfinite(mid.logits).all()


@pytest.mark.slow
def test_a_library_for_another_model_is_refused(config, gemma_dir, smol_dir):
    from contextkit.engine.model import Engine
    from contextkit.spans.assemble import SpanCache

    spans = SpanCache(Engine.from_dir(smol_dir), tokenizer_fingerprint=Tokenizer(smol_dir).fingerprint)
    with pytest.raises(ConfigError, match="same ContextKit"):
        SkillLibrary(Planner(Tokenizer(gemma_dir)), spans)


@pytest.mark.slow
def test_a_skill_compiled_for_its_system_prompt_is_an_exact_prefix_at_once(fresh_kit):
    kit, lib = fresh_kit
    skill = lib.get("brand-guidelines")
    lib.compile(skill, system="Answer briefly.")
    plan = kit.planner.plan(ChatRequest.ask("Which fonts?", skills=(skill,), system="Answer briefly.",
                                            reuse=ReuseOptions()))
    got = kit.spans.assemble(plan).report
    assert got.misses == 0 and got.recomputed_tokens == 0
    assert got.exact_tokens == sum(len(it.span.token_ids) for it in plan.items if it.reuse)
