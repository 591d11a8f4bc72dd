"""The ``bench skillcache`` workload: skills cut to size, Zipf-popular skill sets listed in a random
order, each request rendered through the planner canonically or in request order, and the cache hits an
ideal prefix cache (no eviction) would serve for those prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from contextkit.bench.skills import SYSTEM, _cut
from contextkit.core.errors import ConfigError
from contextkit.core.planner import ChatRequest, Planner
from contextkit.core.prompt import render_skill
from contextkit.core.types import Message, Skill, skill_version


@dataclass(frozen=True, slots=True)
class SkillRequest:
    """One request of the workload: its skills as the client lists them, and its question."""

    skills: tuple[Skill, ...]
    question: str


def load_skills(folder: Path, planner: Planner, max_tokens: int) -> list[Skill]:
    """Every skill under ``folder``, its body cut at a line boundary to at most ``max_tokens`` tokens."""
    from contextkit.synthesis.skills import SkillLibrary

    out = []
    for s in sorted(SkillLibrary(planner).register(folder), key=lambda s: s.name):
        text = _cut(s.text, planner.tokenizer.encode, max_tokens)
        out.append(Skill(s.name, text, skill_version(s.name, text), s.description))
    return out


def workload(skills: list[Skill], questions: list[str], n: int, zipf: float, max_skills: int,
             seed: int) -> list[SkillRequest]:
    """``n`` requests of 1..``max_skills`` distinct skills each, drawn by a Zipf law over seeded popularity
    ranks, listed in a random order, with ``questions`` in turn."""
    if zipf <= 0 or max_skills < 1:
        raise ConfigError("--set zipf must be > 0 and --set max_skills >= 1")
    rng = random.Random(seed)
    ranked = list(skills)
    rng.shuffle(ranked)  # popularity does not follow the names' (canonical) order
    weights = [1.0 / (rank + 1) ** zipf for rank in range(len(ranked))]
    out = []
    for i in range(n):
        pool, w, picked = list(ranked), list(weights), []
        for _ in range(rng.randint(1, min(max_skills, len(ranked)))):
            j = rng.choices(range(len(pool)), weights=w)[0]
            picked.append(pool.pop(j))
            w.pop(j)
        rng.shuffle(picked)  # the order an agent framework happens to list them in
        out.append(SkillRequest(tuple(picked), questions[i % len(questions)]))
    return out


@dataclass(frozen=True, slots=True)
class Rendered:
    """A request's prompt as token ids, and where its skills block sits in it."""

    ids: tuple[int, ...]
    skills_at: int  # tokens before the skills block (the system prompt's)
    skills_len: int


class Renderer:
    """Renders a request through the planner: canonically (its plan), or with the same skill blocks in the
    order the request listed them."""

    def __init__(self, planner: Planner, new_tokens: int):
        self.planner, self.new_tokens = planner, new_tokens

    def chat(self, req: SkillRequest) -> ChatRequest:
        return ChatRequest((Message("system", SYSTEM), Message("user", req.question)), skills=req.skills,
                           max_new_tokens=self.new_tokens)

    def render(self, req: SkillRequest, canonical: bool) -> Rendered:
        chat = self.chat(req)
        head, middle, tail = self.planner.frame(chat)
        assert not middle  # no documents: everything after the skills is the query
        listed = sorted(req.skills, key=lambda s: (s.name, s.version)) if canonical else req.skills
        blocks = [t for s in listed for t in self.planner.skill_tokens(s)]
        ids = (*head, *blocks, *tail)
        if canonical:  # one planner: the proxy sends exactly this
            assert list(ids) == self.planner.plan(chat).ids
        return Rendered(ids, len(head), len(blocks))

    @staticmethod
    def pasted_system(req: SkillRequest) -> str:
        """The system message with the skills pasted in request order, as the planner lays them out."""
        return SYSTEM.rstrip() + "\n\n" + "".join(render_skill(s) for s in req.skills)


def ideal_cached(prompts: list[tuple[int, ...]], block: int) -> list[int]:
    """Cached tokens per prompt from a prefix cache of ``block``-token blocks keyed by chained hashes and
    never evicted (vLLM's rule: full blocks only, never the prompt's last token), prompts in turn."""
    seen: set[int] = set()
    out = []
    for ids in prompts:
        h, hit, cached = 0, True, 0
        servable = (len(ids) - 1) // block
        for b in range(len(ids) // block):
            h = hash((h, ids[b * block:(b + 1) * block]))
            hit = hit and h in seen and b < servable
            cached += block if hit else 0
            seen.add(h)
        out.append(cached)
    return out
