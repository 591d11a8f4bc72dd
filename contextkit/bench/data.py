"""Benchmark data: multi-hop QA records in the shape of ``shared/data/multihop_dev.jsonl``.

Each line: ``{"id", "question", "answers": [...], "passages": [{"title", "text"}, ...]}``. Any file of
that shape works (``--data``), so benchmarks run on data nobody tuned for.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contextkit.core.errors import InputError
from contextkit.core.types import Evidence

# Where the repository's shared data lives relative to a checkout; absent in a user's clone.
SHARED_MULTIHOP = Path("../shared/data/multihop_dev.jsonl")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "question.json"


@dataclass(frozen=True, slots=True)
class QARecord:
    id: str
    question: str
    answers: tuple[str, ...]
    passages: tuple[Evidence, ...]
    source: str = ""  # the dataset it came from ("hotpotqa", "musique", ...): benches report per source


def _record(obj: dict, where: str) -> QARecord:
    try:
        passages = tuple(
            Evidence(text=p["text"], title=p.get("title"), id=str(i)) for i, p in enumerate(obj["passages"])
        )
        return QARecord(
            id=str(obj.get("id", where)),
            question=obj["question"],
            answers=tuple(obj.get("answers") or ()),
            passages=passages,
            source=str(obj.get("dataset") or obj.get("source") or ""),
        )
    except (KeyError, TypeError) as exc:
        raise InputError(
            f"{where}: expected {{question, answers, passages: [{{title, text}}]}}, missing {exc}"
        ) from exc


def load_records(path: Path | None = None) -> list[QARecord]:
    """Records from ``path``; default: the shared multihop set, else the bundled example question."""
    if path is None:
        path = SHARED_MULTIHOP if SHARED_MULTIHOP.is_file() else EXAMPLE
    if path.suffix == ".json":  # the example file: one {system, documents, question, answers}
        obj = json.loads(path.read_text())
        return [_record({**obj, "passages": obj["documents"]}, str(path))]
    records = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{i} is not valid JSON ({exc.msg}); fix or remove that line") from exc
        records.append(_record(obj, f"{path}:{i}"))
    if not records:
        raise InputError(f"{path} holds no records; pass a JSONL with one question per line")
    return records


def sample(records: list[QARecord], n: int, seed: int) -> list[QARecord]:
    """``n`` records drawn without replacement (with replacement past the file's size), seeded."""
    rng = random.Random(seed)
    if n <= len(records):
        return rng.sample(records, n)
    return [rng.choice(records) for _ in range(n)]


SPLITS = ("all", "tune", "heldout")


def shared_half(data: Path | None, half: str) -> str:
    """A bench's default split: ``half`` of the shared dev file when it reads that file (no ``--data``),
    else "all" (a user's own file is not split)."""
    return half if data is None and SHARED_MULTIHOP.is_file() else "all"


def split(records: Sequence[QARecord], part: str) -> list[QARecord]:
    """One half of ``records`` by a hash of each id: defaults are chosen on "tune", reported on "heldout".

    The halves do not depend on the file's order or size, so a record stays on its side in any file.
    """
    if part not in SPLITS:
        raise InputError(f"split must be one of {', '.join(SPLITS)}, got {part!r}")
    if part == "all":
        return list(records)
    want = 0 if part == "tune" else 1
    return [r for r in records if int(hashlib.sha256(r.id.encode()).hexdigest(), 16) % 2 == want]


def with_distractors(
    record: QARecord, pool: Sequence[QARecord], tokens: Callable[[Sequence[Evidence]], int], lo: int, hi: int,
    seed: int,
) -> tuple[Evidence, ...] | None:
    """The record's passages plus passages of other records, shuffled, rendering to ``lo..hi`` tokens.

    Long contexts for a QA record whose own passages are short: distractors are drawn (seeded) from
    other records of the same file, so any file in the multihop shape gives every length band. The
    record's own passages land at random ranks. ``tokens(passages)`` is the rendered prompt's length.
    None when the band cannot be reached (the record alone is longer than ``hi``).
    """
    rng = random.Random(f"{seed}:{record.id}")
    passages = [Evidence(text=p.text, title=p.title, id=f"q{i}") for i, p in enumerate(record.passages)]
    length = tokens(passages)  # each call renders a whole prompt: keep the current one's length
    if length > hi:
        return None
    others = [Evidence(text=p.text, title=p.title, id=f"d{j}")
              for j, p in enumerate(p for r in pool if r.id != record.id for p in r.passages)]
    rng.shuffle(others)
    for p in others:
        if length >= lo:
            break
        trial = passages + [p]
        trial_length = tokens(trial)
        if trial_length <= hi:
            passages, length = trial, trial_length
    if length < lo:
        return None
    rng.shuffle(passages)
    return tuple(Evidence(text=p.text, title=p.title, id=str(i)) for i, p in enumerate(passages))
