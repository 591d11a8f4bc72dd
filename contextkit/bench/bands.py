"""Prompt-length bands: QA questions rendered to a band of context tokens (padded with other questions'
passages where a band is longer than a question's own), shared by ``bench spans`` and ``calibrate``."""

from __future__ import annotations

from collections.abc import Sequence

from contextkit.bench.data import QARecord, sample, with_distractors
from contextkit.core.errors import ConfigError
from contextkit.core.plan import RequestPlan
from contextkit.core.planner import ChatRequest, Planner

# band -> (min tokens, max tokens, how a question's passages are fitted to it): "whole" (as they are),
# "padded" (other questions' passages added), "trimmed" (the last passages left out: short prompts, where
# a reuse has the least to save and its fixed costs weigh most)
BANDS: dict[str, tuple[int, int, str]] = {
    "0.25k": (150, 400, "trimmed"), "1.5k": (1000, 2100, "whole"), "3k": (2700, 3300, "padded"),
    "4k": (3600, 4400, "padded"), "6k": (5400, 6600, "padded"),
}


def band_key(name: str, band: str) -> str:
    """Summary keys of the 1.5k band are unsuffixed (the keys of earlier runs); others end in ``_<band>``."""
    return name if band == "1.5k" else f"{name}_{band}"


def parse_bands(text: str, option: str = "--set bands") -> list[str]:
    """``"1.5k,3k"`` -> the bands, each checked."""
    bands = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in bands if b not in BANDS]
    if bad or not bands:
        raise ConfigError(f"{option}: unknown band(s) {bad or [text]}; choose from {', '.join(BANDS)}")
    return bands


def choose_questions(planner: Planner, records: Sequence[QARecord], band: str, *, decode: int, count: int,
                     seed: int, lo: int | None = None, hi: int | None = None) -> list[tuple[QARecord, RequestPlan]]:
    """Up to ``count`` questions (in a seeded order) whose documents request renders to ``band``'s length
    (``lo``/``hi`` override its bounds), each with its plan (retrieval order, ``decode`` tokens to answer)."""
    b_lo, b_hi, fit = BANDS[band]
    lo, hi = b_lo if lo is None else lo, b_hi if hi is None else hi

    def plan_of(rec: QARecord, passages) -> RequestPlan:
        return planner.plan(ChatRequest.ask(rec.question, passages, ordering="retrieval", max_new_tokens=decode))

    chosen = []
    for rec in sample(list(records), len(records), seed):
        if fit == "padded":
            passages = with_distractors(rec, records, lambda ps, rec=rec: plan_of(rec, ps).num_tokens, lo, hi, seed)
            if passages is None:
                continue
            plan = plan_of(rec, passages)
        else:
            plan = plan_of(rec, rec.passages)
            keep = len(rec.passages)
            while fit == "trimmed" and plan.num_tokens > hi and keep > 1:
                keep -= 1
                plan = plan_of(rec, rec.passages[:keep])
            if not lo <= plan.num_tokens <= hi:
                continue
        chosen.append((rec, plan))
        if len(chosen) == count:
            break
    return chosen
