"""A skill library: skills registered from folders, versioned by content, compiled once into position-free
span KV, retrieved by name or by meaning, and edited with errata instead of recompiles.

Layout it reads (``../shared/data/skills``): any folder holding ``SKILL.md`` files, each with YAML front
matter (``name``, ``description``) and the body the model reads; reference files beside it; and, when
present, a ``skills_index.jsonl`` at the root (one row per file: ``kind`` "skill" or "reference",
``skill``, ``path``) that names each skill's references.

Versions. A skill's version is a hash of its name and body. Registering a changed body under a known
name adds a version and makes it current; an older version stays while a request holds it
(``SkillLibrary.hold``) and is dropped when the last holder lets go.

Where skills go. The planner renders a request's skills at the end of its system message, in one
canonical order (``contextkit.core.planner``): on the prompt path a popular skill set is one prefix that
vLLM's prefix cache keeps; on the KV path each skill is a span whose KV ``compile`` put in the store once
(any tier: a remote tier makes it a hit in every process sharing it), re-positioned into the request
with its recompute policy. At its canonical place (after a given system prompt) a skill is anchored: a
request that finds no exact prefix link for it there re-positions it and leaves its place to be computed
off the request path (``compile(skill, system=...)`` does that ahead of time), so later requests with
that system prompt reuse it exactly, nothing recomputed. ``items`` gives the plan items of a skill for
a plan built by hand, to splice
it anywhere else (mid-conversation).

Errata. ``edit`` changes a field of a skill (a version number, a tool name): while the edits are few and
small (``ErrataRule``) the compiled KV stays as it is and a short correction is appended after the skill
(``Skill.errata``, computed in context), otherwise the edited text is a new version that is compiled
again. The result says which, and why.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.plan import PlanItem
from contextkit.core.planner import ChatRequest, Planner
from contextkit.core.tenant import Tenant
from contextkit.core.types import Skill, Span, skill_version

MAX_NAME_CHARS = 128


class SkillError(InputError):
    """A skill that cannot be registered, found or edited as asked (the message says which and how to fix it)."""


@dataclass(frozen=True, slots=True)
class SkillFile:
    """A registered skill version and where it came from."""

    skill: Skill
    path: Path | None = None
    references: tuple[Path, ...] = ()


def parse_skill(text: str, where: str = "SKILL.md") -> tuple[dict, str]:
    """(front matter, body) of a ``SKILL.md``; ``SkillError`` naming ``where`` when the front matter is
    missing, not YAML, or lacks a name or description."""
    import yaml

    if not text.startswith("---"):
        raise SkillError(f"{where}: no front matter; start the file with a '---' line, 'name: ...', "
                         "'description: ...' and a closing '---'")
    end = text.find("\n---", 3)
    if end < 0:
        raise SkillError(f"{where}: the front matter has no closing '---' line")
    try:
        meta = yaml.safe_load(text[3:end])
    except yaml.YAMLError as exc:
        raise SkillError(f"{where}: the front matter is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(meta, dict):
        raise SkillError(f"{where}: the front matter must be a mapping with name and description")
    for key in ("name", "description"):
        if not isinstance(meta.get(key), str) or not meta[key].strip():
            raise SkillError(f"{where}: the front matter needs a non-empty {key!r}")
    name = meta["name"].strip()
    if len(name) > MAX_NAME_CHARS or any(c in name for c in "\x00\n@"):
        raise SkillError(f"{where}: skill name {name[:40]!r} must be one line of at most {MAX_NAME_CHARS} "
                         "characters without '@'")
    body = text[end + 4 :].lstrip("-").strip()
    if not body:
        raise SkillError(f"{where}: the skill has no body after its front matter")
    return meta, body


@dataclass(frozen=True, slots=True)
class ErrataRule:
    """When an edit is an appended erratum and when the skill is recompiled.

    Attributes:
        max_errata: errata a skill may carry; one more recompiles (with every edit applied).
        max_edit_share: an edit whose replaced text is more than this share of the skill's characters
            recompiles (an erratum corrects a field, not a section).
    """

    max_errata: int = 3
    max_edit_share: float = 0.02

    def __post_init__(self) -> None:
        if self.max_errata < 0 or not 0.0 <= self.max_edit_share <= 1.0:
            raise ConfigError("errata rule: max_errata >= 0 and max_edit_share in [0, 1]")


@dataclass(frozen=True, slots=True)
class Edit:
    """What ``SkillLibrary.edit`` did: the skill now current, and whether it was an erratum or a recompile."""

    skill: Skill
    mode: Literal["erratum", "recompile"]
    reason: str


@dataclass
class _Entry:
    versions: list[SkillFile] = field(default_factory=list)  # oldest first; the last one is current


class SkillLibrary:
    """Skills by name, each with its versions; compiled into a span cache, retrieved by name or meaning.

    Args:
        planner: renders skills to tokens (the model's tokenizer): the tokens ``compile`` stores are the
            ones every request's plan holds.
        spans: the span cache skills compile into (``ContextKit.spans``); None: the prompt path only.
        rule: when an edit is an erratum and when it recompiles.
    """

    def __init__(self, planner: Planner, spans=None, rule: ErrataRule = ErrataRule()):
        if spans is not None and spans.identity.tokenizer and planner.tokenizer.fingerprint != spans.identity.tokenizer:
            raise ConfigError("the skill library's tokenizer is not the span cache's model's: build the library "
                              "from the same ContextKit (kit.planner, kit.spans)")
        self.planner, self.spans, self.rule = planner, spans, rule
        self._skills: dict[str, _Entry] = {}
        self._held: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._index = None  # (names, VectorIndex), rebuilt when the set of names changes
        self._embedder = None

    # -- registering ------------------------------------------------------------------------------

    def add(self, name: str, text: str, description: str = "", path: Path | None = None,
            references: Sequence[Path] = ()) -> Skill:
        """Register ``text`` as skill ``name``: the current version if the body is known, else a new one."""
        skill = Skill(name, text, skill_version(name, text), description)
        with self._lock:
            entry = self._skills.setdefault(name, _Entry())
            if entry.versions and entry.versions[-1].skill.version == skill.version:
                return entry.versions[-1].skill
            entry.versions.append(SkillFile(skill, path, tuple(references)))
            self._prune(name)
            self._index = None
        return skill

    def register(self, folder: Path | str) -> list[Skill]:
        """Every ``SKILL.md`` under ``folder`` (see the module docstring); all or nothing: a bad file or
        two files naming one skill with different bodies raise ``SkillError`` and register nothing."""
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise SkillError(f"skills folder {root} does not exist")
        found: dict[str, tuple[dict, str, Path]] = {}
        for path in sorted(root.rglob("SKILL.md")):
            meta, body = parse_skill(path.read_text(encoding="utf-8", errors="replace"), str(path))
            name = meta["name"].strip()
            if name in found and found[name][1] != body:
                raise SkillError(f"skill {name!r} is defined twice with different content: {found[name][2]} and "
                                 f"{path}; rename one (the name in its front matter)")
            found[name] = (meta, body, path)
        if not found:
            raise SkillError(f"no SKILL.md under {root}")
        refs = self._references(root)
        return [self.add(name, body, meta["description"].strip(), path, refs.get(name, ()))
                for name, (meta, body, path) in found.items()]

    @staticmethod
    def _references(root: Path) -> dict[str, tuple[Path, ...]]:
        index = root / "skills_index.jsonl"
        out: dict[str, list[Path]] = {}
        if index.is_file():
            for line in index.read_text().splitlines():
                row = json.loads(line) if line.strip() else {}
                if row.get("kind") == "reference" and row.get("skill"):
                    out.setdefault(row["skill"], []).append(root / row["path"])
        return {k: tuple(v) for k, v in out.items()}

    # -- looking up -------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return sorted(self._skills)

    def get(self, name: str, version: str | None = None) -> Skill:
        """The current version of ``name`` (or the one asked for, while it is kept)."""
        entry = self._skills.get(name)
        if entry is None or not entry.versions:
            raise SkillError(f"no skill named {name!r}; registered: {', '.join(self.names[:10]) or 'none'}"
                             + (" ..." if len(self._skills) > 10 else ""))
        if version is None:
            return entry.versions[-1].skill
        for f in entry.versions:
            if f.skill.version == version:
                return f.skill
        raise SkillError(f"skill {name!r} has no version {version!r} (kept: "
                         f"{', '.join(f.skill.version for f in entry.versions)})")

    def file(self, name: str) -> SkillFile:
        self.get(name)
        return self._skills[name].versions[-1]

    def versions(self, name: str) -> list[Skill]:
        self.get(name)
        return [f.skill for f in self._skills[name].versions]

    def retrieve(self, task: str, k: int = 1) -> list[tuple[Skill, float]]:
        """The ``k`` skills whose name and description are most similar to ``task`` (cosine of MiniLM
        embeddings), best first, with their scores."""
        if not task or not task.strip():
            raise SkillError("retrieve needs a task description")
        if not self._skills:
            raise SkillError("the library is empty; register a skills folder first")
        from contextkit.synthesis.embed import Embedder, VectorIndex

        with self._lock:
            if self._embedder is None:
                self._embedder = Embedder()
            if self._index is None:
                names = self.names
                texts = [f"{n}: {self.get(n).description}" for n in names]
                self._index = (names, VectorIndex(self._embedder(texts)))
            names, index = self._index
        scores, idx = index.search(self._embedder([task]), k)
        return [(self.get(names[i]), float(s)) for s, i in zip(scores[0], idx[0]) if i >= 0]

    # -- holding versions -------------------------------------------------------------------------

    @contextmanager
    def hold(self, *skills: Skill) -> Iterator[tuple[Skill, ...]]:
        """Keep these versions while a request uses them (a newer version does not drop them)."""
        with self._lock:
            for s in skills:
                self._held[(s.name, s.version)] += 1
        try:
            yield skills
        finally:
            with self._lock:
                for s in skills:
                    self._held[(s.name, s.version)] -= 1
                    if self._held[(s.name, s.version)] <= 0:
                        del self._held[(s.name, s.version)]
                    self._prune(s.name)

    def _prune(self, name: str) -> None:
        """Drop versions older than the current one that nothing holds (under the lock)."""
        entry = self._skills.get(name)
        if entry is None:
            return
        current = entry.versions[-1]
        entry.versions = [f for f in entry.versions[:-1] if self._held[(name, f.skill.version)] > 0] + [current]

    # -- compiling and splicing -------------------------------------------------------------------

    def tokens(self, skill: Skill) -> tuple[int, ...]:
        """The skill's block of tokens (what every plan holding it carries)."""
        return self.planner.skill_tokens(skill)

    def compile(self, skill: Skill, tenant: Tenant | str = "", system: str | None = None) -> bool:
        """Compile the skill's KV into the span cache's store once; True if it was already there.

        With ``system``, also compute it in its canonical place, after that system prompt, and keep it as
        an exact prefix link: a request with that system prompt and this skill (alone, or first in the
        canonical order) then reuses it exactly, with nothing recomputed. The position-free KV serves
        every other place (another system prompt, mid-conversation) with the request's recompute policy.
        """
        if self.spans is None:
            raise ConfigError("this library has no span cache: build it with SkillLibrary(kit.planner, kit.spans)")
        _, hit = self.spans.compiled(Span(self.tokens(skill), "skill", skill.name), tenant=tenant)
        if system is not None:  # the system prompt and the skill, in place: exact prefix links
            plan = self.planner.plan(ChatRequest.ask("?", skills=(skill,), system=system, tenant=Tenant.of(tenant)))
            upto = next(i for i, it in enumerate(plan.items) if it.span.kind == "skill")
            self.spans.extend_prefix([it.span for it in plan.items[: upto + 1]], tenant)
        return hit

    def items(self, skill: Skill) -> tuple[PlanItem, ...]:
        """The plan items of a skill, to splice into a plan built by hand at any point: the skill's span
        (reused) and its errata (computed in context, after it)."""
        out = [PlanItem(Span(self.tokens(skill), "skill", f"{skill.name}@{skill.version}"))]
        for ids in self.planner.errata_tokens(skill):
            out.append(PlanItem(Span(ids, "skill", f"{skill.name}@{skill.version}:erratum"), reuse=False))
        return tuple(out)

    # -- editing ----------------------------------------------------------------------------------

    def edit(self, name: str, old: str, new: str) -> Edit:
        """Replace the field ``old`` with ``new`` in skill ``name``: an appended erratum while the rule
        allows it (the compiled KV stays valid and prefix-aligned), else a recompiled new version."""
        if not old or old == new:
            raise SkillError("an edit needs the text to replace (old) and a different new text")
        current = self.get(name)
        edited = current.text  # the errata applied so far, then this one
        for o, n in current.errata:
            edited = edited.replace(o, n)
        if old not in edited:
            raise SkillError(f"skill {name!r} does not contain {old[:60]!r}; an erratum corrects text the skill has")
        errata = (*current.errata, (old, new))
        share = len(old) * edited.count(old) / max(1, len(current.text))
        if len(errata) > self.rule.max_errata:
            reason = f"{len(errata)} errata, over the rule's {self.rule.max_errata}"
        elif share > self.rule.max_edit_share:
            reason = f"the edit replaces {share:.1%} of the skill, over the rule's {self.rule.max_edit_share:.0%}"
        else:
            skill = replace(current, errata=errata)
            with self._lock:
                entry = self._skills[name]
                entry.versions[-1] = replace(entry.versions[-1], skill=skill)
            return Edit(skill, "erratum", f"erratum {len(errata)} of at most {self.rule.max_errata}")
        f = self.file(name)
        skill = self.add(name, edited.replace(old, new), current.description, f.path, f.references)
        return Edit(skill, "recompile", reason)
