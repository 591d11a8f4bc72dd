"""Benchmark data: multi-hop QA records in the shape of ``shared/data/multihop_dev.jsonl``.

Each line: ``{"id", "question", "answers": [...], "passages": [{"title", "text"}, ...]}``. Any file of
that shape works (``--data``), so benchmarks run on data nobody tuned for.
"""

from __future__ import annotations

import json
import random
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
