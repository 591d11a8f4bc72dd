"""Fidelity and answer-quality metrics shared by the benchmarks."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import torch


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || approximation) of the next-token distributions, in nats."""
    p = reference_logits.float().log_softmax(-1)
    q = logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def _normalize(text: str) -> str:
    """SQuAD answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def answer_f1(prediction: str, answers: Sequence[str]) -> float:
    """Best token-level F1 of ``prediction`` against any gold answer (0..1)."""
    best = 0.0
    pred = _normalize(prediction).split()
    for gold in answers:
        ref = _normalize(gold).split()
        common = Counter(pred) & Counter(ref)
        same = sum(common.values())
        if same == 0:
            continue
        precision, recall = same / len(pred), same / len(ref)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def answer_em(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer, else 0.0."""
    pred = _normalize(prediction)
    return float(any(pred == _normalize(a) for a in answers))


def token_f1(prediction: str, reference: str) -> float:
    """Token F1 of two answers (``answer_agreement_f1``: 1.0 = the same answer; two empty answers agree)."""
    if not _normalize(prediction) and not _normalize(reference):
        return 1.0
    return answer_f1(prediction, [reference])
