"""The calibration profile file's schema (``spans/calibration.py``), checked field by field when it is read:
types (strict: a number is a JSON number, an int an integer, no NaN or infinity), ranges and the per-prompt
lists' lengths, so a bad file is a ``CalibrationError`` naming the field, never a value that raises later
inside vLLM's scheduler (where the connector resolves a budget with it) and stops the engine for every tenant."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from contextkit.core.errors import CalibrationError
from contextkit.spans.calibration import KV_SOURCES, POINT_POLICIES, Band, CalibrationProfile, Point


def checked_profile(raw: dict, source: str) -> CalibrationProfile:
    """The profile in ``raw`` (a file's JSON less its format tag), or a ``CalibrationError`` naming the first
    field out of range."""
    try:
        return _ProfileFile.model_validate(raw).profile()
    except ValidationError as exc:
        raise CalibrationError(f"{source} is not a valid calibration profile: {_first_error(exc)}; run "
                               "`contextkit calibrate` again") from None


class _Checked(BaseModel):
    # strict: a number must be a JSON number (no "0.5", no true), an int an integer; no NaN or infinity
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _PointFile(_Checked):
    ratio: float = Field(ge=0.0, le=1.0)
    answer_kl: list[float] = Field(min_length=1)
    tf_agreement: list[float] = Field(min_length=1)
    speedup: float = Field(gt=0.0)
    probe_layers: int | None = Field(default=None, ge=0)
    shift: list[float] = Field(default_factory=list)
    first_k: int | None = Field(default=None, ge=1)
    policy: str | None = None  # absent (files before kv_deviation points): first_k's or query_attention

    @model_validator(mode="after")
    def _per_prompt(self) -> _PointFile:
        if self.policy is None:
            self.policy = "first_k" if self.first_k is not None else "query_attention"
        if self.policy not in POINT_POLICIES:
            raise ValueError(f"policy {self.policy!r} is not a calibrated policy ({', '.join(POINT_POLICIES)})")
        if (self.first_k is not None) != (self.policy == "first_k"):
            raise ValueError("a first_k point, and only one, has first_k")
        if self.first_k is not None and (self.ratio != 0 or self.probe_layers is not None):
            raise ValueError("a first_k point recomputes only its sinks: its ratio is 0 and it has no probe_layers")
        if self.policy == "kv_deviation" and self.probe_layers is not None:
            raise ValueError("a kv_deviation point runs no probe: it has no probe_layers")
        if any(k < 0 for k in self.answer_kl):
            raise ValueError("answer_kl holds a negative KL")
        if any(not 0.0 <= a <= 1.0 for a in self.tf_agreement):
            raise ValueError("tf_agreement holds a value outside [0, 1]")
        if len(self.tf_agreement) != len(self.answer_kl):
            raise ValueError(f"{len(self.answer_kl)} answer_kl values but {len(self.tf_agreement)} tf_agreement")
        if self.shift and len(self.shift) != len(self.answer_kl):
            raise ValueError(f"{len(self.answer_kl)} answer_kl values but {len(self.shift)} shift")
        if any(d < 0 for d in self.shift):
            raise ValueError("shift holds a negative value")
        return self


class _BandFile(_Checked):
    name: str = Field(min_length=1)
    context_tokens: int = Field(ge=1)
    points: list[_PointFile] = Field(min_length=1)


class _ProfileFile(_Checked):
    """The profile file's schema, checked field by field (ranges, types) before anything uses it."""

    model_digest: str = Field(min_length=1)
    dtype: str = Field(min_length=1)
    quantile: float = Field(gt=0.0, lt=1.0)
    answer_tokens: int = Field(ge=1)
    data: str
    bands: list[_BandFile] = Field(min_length=1)
    first_k: int = Field(default=2, ge=0)
    probe_layers: int = Field(default=8, ge=0)
    machine: str = ""
    kv_source: str = Field(default="compiled", pattern="^(" + "|".join(KV_SOURCES) + ")$")

    def profile(self) -> CalibrationProfile:
        bands = tuple(Band(b.name, b.context_tokens, tuple(
            Point(p.ratio, tuple(p.answer_kl), tuple(p.tf_agreement), p.speedup, p.probe_layers, tuple(p.shift),
                  p.first_k, p.policy or "query_attention")
            for p in b.points))
            for b in self.bands)
        return CalibrationProfile(self.model_digest, self.dtype, self.quantile, self.answer_tokens, self.data, bands,
                                  self.first_k, self.probe_layers, self.machine, self.kv_source)


def _first_error(exc: ValidationError) -> str:
    """``bands[0].points[2].ratio: Input should be less than or equal to 1 (got 1.5)``: where and what."""
    err = exc.errors()[0]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in err["loc"]).lstrip(".")
    got = "" if err["type"] in ("missing", "value_error") else f" (got {err['input']!r:.60})"
    return f"{where or 'the file'}: {err['msg']}{got}"
