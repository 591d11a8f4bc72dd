"""A model's calibration profile: what each recompute setting did to answers, per prompt-length band.

``contextkit calibrate`` (``contextkit.bench.calibrate``) runs the tune half of a QA file through the
span cache at several settings in series: query_attention ratios at one or more probe depths, first_k
alone (EPIC's LegoLink: the first k tokens of each reused span recomputed, no probe) at several k, and
kv_deviation ratios (CacheBlend's selection at its check layer). A profile is for one KV source
(``KV_SOURCES``): spans compiled alone (the built-in engine's store; the default) or spans saved out of an
earlier request's context, where they sat in another order (what vLLM's connector loads with
``context_spans``): what a setting does depends on the stale KV it repairs. Per
prompt it measures the answer KL over the whole teacher-forced answer against full prefill in the same
dtype (``contextkit.spans.fidelity``). The profile keeps those per-prompt numbers, keyed by the model's
weights digest and dtype, and answers one question at request time (``choose``): for a prompt of this
many context tokens and a budget of b nats per answer token, which is the fastest setting whose answer
KL stays within b on the profile's quantile of the calibration prompts of the nearest length band?

The fit is conservative, not a curve, in three ways:
- a setting's answer KL is bounded, not estimated: of its n calibration prompts, the ceil((n+1)q)-th
  smallest (``upper_bound``: the split-conformal quantile; a new prompt drawn like the calibration ones
  stays at or below it with probability at least q). The plain q-quantile of 16 prompts held on 50-81% of
  held-out prompts instead of 90% (docs/benchmarks.md, "Fidelity budget and calibration"); with too few
  prompts (n < q / (1 - q), 9 at q = 0.9) nothing can be bounded and the band runs full prefill;
- within one series (a probe depth's ratios; first_k's k) settings are ordered by cost, and a setting
  qualifies only if it and every costlier setting of its series meet the budget, so one lucky point
  below a bad one is never chosen;
- of the qualifying settings, of every series, the one measured fastest (``Point.speedup``, median TTFT
  against full prefill on the same prompts; within 5% counts as a tie, won by the smaller bound) is
  chosen: a deeper probe costs more per request but may reach the budget at a lower ratio, and only
  the measurement says which is faster; a setting measured
  slower than full prefill is never chosen, since full prefill is exact and faster.
The tail is caught per request. A ratio-only setting must hold the budget on the prompts that need the
most recompute, so a few such prompts push every request to a costlier ratio. Each request measures, for
free, how far its recompute moved the keys it recomputed (``ReuseReport.recompute_shift``: the mean
relative change of K at the recomputed tokens, over layers and KV heads): a prompt whose recomputed tokens
moved far is one whose stale tokens are likely off too. Calibrate keeps it per prompt (``Point.shift``). A
setting that misses the budget may still qualify with a tail gate: a request whose shift is over the gate
runs as a full prefill instead (exact), and the gate is the loosest under which the answer KL bound, with
the gated prompts counted exact, holds the budget (the same split-conformal bound: a miss is monotone in
the gate, so the bound holds for the gate chosen on the data, conformal risk control's argument). The
gate costs its full prefills (after the reuse it replaces), so a gated setting competes on its expected
speedup (``Qualified.speedup``); where the shift does not track the answer KL, no gate pays and none is
chosen. (The probe's own estimate, the query's attention left on stale KV, did not track it on
Qwen2.5-0.5B: docs/benchmarks.md, "Catching the tail per request".)
When none qualifies the request is a full prefill (exact). A profile made for other weights or another
dtype is refused (``CalibrationError``), never used; so is one whose values are out of range (a ratio above
1, a negative probe depth, an answer KL that is not a finite number >= 0, ...): the file is checked field by
field when it is read (``spans/profile_file.py``), since vLLM's connector resolves a budget with it inside vLLM's
scheduler, where a bad value raising would stop the engine for every tenant.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from contextkit.core.config import machine_class
from contextkit.core.errors import CalibrationError
from contextkit.core.policy import REPAIR_POLICIES, ReuseOptions

FORMAT = "contextkit-calibration-v1"
# Where a profile's reused KV came from. "compiled": each span computed alone from position 0 (the built-in
# engine's span store). "context": each span cut out of an earlier request that held the same passages in
# another order (vLLM's connector with context_spans: spans saved from their first request's context).
KV_SOURCES = ("compiled", "context")
# A calibrated setting's policy: each policy that recomputes (core.policy's table) but the budget itself:
# query_attention (a probe depth's ratios), first_k alone (its k), kv_deviation (its ratios)
POINT_POLICIES = tuple(p for p in REPAIR_POLICIES if p != "budget")
# Speedups within this factor of the fastest qualifying setting's are not told apart: a median of 24
# prompts on a shared CPU moves by a few percent between runs (at budget 0.05 on the tune half, 2026-12-05,
# r=0.5 measured 1.498x with the 8-layer probe and 1.485x with the all-layer one, whose bound is 0.023
# against 0.039), so the more faithful of such settings is taken.
SPEED_TIE = 1.05
log = logging.getLogger(__name__)


def _source_suffix(kv_source: str) -> str:
    if kv_source not in KV_SOURCES:
        raise CalibrationError(f"unknown KV source {kv_source!r}; one of {', '.join(KV_SOURCES)}")
    return "" if kv_source == "compiled" else f"-{kv_source}"


def profile_path(model_dir: Path | str, dtype: str, kv_source: str = "compiled") -> Path:
    """Where ``contextkit calibrate`` writes a model's profile for ``dtype`` and ``kv_source``: beside its
    weights (``contextkit-calibration-bfloat16.json``; ``...-bfloat16-context.json`` for context KV)."""
    return Path(model_dir) / f"contextkit-calibration-{dtype}{_source_suffix(kv_source)}.json"


def minimum_prompts(q: float) -> int:
    """The fewest calibration prompts that can bound a q-quantile at all (ceil((n+1)q) <= n, so n >= q/(1-q))."""
    if not 0 < q < 1:
        raise CalibrationError(f"a calibration quantile must be in (0, 1), not {q}; run `contextkit calibrate` again")
    return max(1, math.ceil(round(q / (1 - q), 9)))


def upper_bound(values: list[float] | tuple[float, ...], q: float) -> float:
    """The ceil((n+1)q)-th smallest of n values (q in (0, 1]): a new value exchangeable with these is at or
    below it with probability at least q (split conformal). ``inf`` when n < ``minimum_prompts(q)``.

    Not the interpolated q-quantile on purpose: that is an estimate, exceeded on about 1 - q of new
    prompts plus its sampling error, which at 16 prompts is most of the tail."""
    if not values:
        raise CalibrationError("a calibration point with no prompts")
    k = math.ceil(round((len(values) + 1) * q, 9))  # round: (n+1)*0.9 in floats is 15.300000000000001
    return math.inf if k > len(values) else sorted(values)[k - 1]


@dataclass(frozen=True, slots=True)
class Point:
    """One setting measured on one band's calibration prompts (the same prompts for every point)."""

    ratio: float  # query_attention's recompute ratio (uncapped); 0: reuse with first-k sinks only
    answer_kl: tuple[float, ...]  # per prompt: mean KL per answer token against same-dtype full prefill
    tf_agreement: tuple[float, ...]  # per prompt: teacher-forced agreement with it
    speedup: float  # median TTFT of same-dtype full prefill over this setting's
    probe_layers: int | None = None  # the probe's depth (0: all layers); None: the profile's ``probe_layers``
    # per prompt: how far this setting's recompute moved the keys it recomputed (``ReuseReport.
    # recompute_shift``), the tail gate's signal; empty where the profile predates it
    shift: tuple[float, ...] = ()
    # None: query_attention or kv_deviation at ``ratio`` with the profile's sinks; k: policy "first_k" (EPIC's
    # LegoLink): the first k tokens of each reused span recomputed in context and nothing else (ratio 0)
    first_k: int | None = None
    policy: str = "query_attention"  # one of POINT_POLICIES ("first_k" exactly when ``first_k`` is set)

    def __post_init__(self) -> None:
        if self.policy not in POINT_POLICIES or (self.first_k is not None) != (self.policy == "first_k"):
            raise CalibrationError(f"a calibration point of policy {self.policy!r} with first_k={self.first_k}: "
                                   f"the policy is one of {', '.join(POINT_POLICIES)}, and first_k's alone has a k")


@dataclass(frozen=True, slots=True)
class Band:
    name: str
    context_tokens: int  # median context tokens of its calibration prompts
    points: tuple[Point, ...]  # per series (``CalibrationProfile.series``), sorted by cost


@dataclass(frozen=True, slots=True)
class Choice:
    """What the profile chose for one request."""

    options: ReuseOptions  # the setting to run (policy "full" when none is within the budget)
    band: str
    predicted_kl: float  # the chosen setting's answer KL bound at the profile's quantile (0 for full prefill)
    # the tail gate: a request whose recompute moved the keys it recomputed further than this
    # (``ReuseReport.recompute_shift``) runs as a full prefill instead; None: no gate
    tail_gate: float | None = None
    expected_speedup: float = 1.0  # the setting's measured speedup, less what its gate's full prefills cost


@dataclass(frozen=True, slots=True)
class Qualified:
    """A setting that holds a budget: its point, its answer KL bound, its tail gate (None: ungated) and its
    expected speedup over full prefill (the point's, less its gate's full prefills)."""

    point: Point
    bound: float
    gate: float | None
    speedup: float


def gated(point: Point, gate: float) -> tuple[float, ...]:
    """The point's per-prompt answer KL with its tail gate at ``gate``: a prompt whose shift is over the gate
    runs as a full prefill, the reference itself (KL 0)."""
    return tuple(0.0 if d > gate else k for k, d in zip(point.answer_kl, point.shift))


@dataclass(frozen=True, slots=True)
class CalibrationProfile:
    model_digest: str
    dtype: str
    quantile: float  # the share of prompts like the calibration ones a setting must keep within the budget
    answer_tokens: int
    data: str  # what it was calibrated on
    bands: tuple[Band, ...]
    first_k: int = 2
    probe_layers: int = 8
    # where the speedups were measured (``core.config.machine_class``; "": not recorded): fidelity is the
    # model's and dtype's, the speed order of settings the machine's
    machine: str = ""
    kv_source: str = "compiled"  # the reused KV it was measured on (KV_SOURCES)

    @property
    def id(self) -> str:
        """Short, for reports: the digest's head, the dtype, and the KV source unless "compiled"."""
        return f"{self.model_digest[:12]}-{self.dtype}{_source_suffix(self.kv_source)}"

    def band_for(self, context_tokens: int) -> Band:
        """The band whose calibration prompts are nearest in length (log scale)."""
        n = max(context_tokens, 1)
        return min(self.bands, key=lambda b: abs(math.log(n / max(b.context_tokens, 1))))

    def depth(self, point: Point) -> int:
        """The probe depth ``point`` was measured with (0: all layers)."""
        return self.probe_layers if point.probe_layers is None else point.probe_layers

    def probe_depth(self, point: Point) -> int | None:
        """The probe depth ``point`` runs (0: all layers); None for first_k and kv_deviation, which run none."""
        return self.depth(point) if point.policy == "query_attention" else None

    def series(self, point: Point) -> tuple[str, int]:
        """The series ``point`` belongs to, whose points differ in one cost knob: query_attention at one
        probe depth (the ratio varies), first_k alone (k varies) or kv_deviation (the ratio varies); 0 stands
        for the depth of a series that runs no probe."""
        return (point.policy, self.probe_depth(point) or 0)

    def qualifying(self, budget: float, band: Band) -> list[Qualified]:
        """The settings of ``band`` that hold ``budget``: a point whose answer KL bound (``upper_bound`` at
        ``quantile``) is within it, it and every costlier point of its series (``series``), runs ungated; a
        point that does not, but measured its recompute's shift per prompt (``Point.shift``), qualifies with
        the loosest tail gate under which it and every costlier point of its series hold the budget, a prompt
        over the gate counted as a full prefill (answer KL 0: ``gated``)."""
        out = []
        for key in {self.series(p) for p in band.points}:
            series = sorted((p for p in band.points if self.series(p) == key), key=lambda p: (p.ratio, p.first_k or 0))
            for i, p in enumerate(series):
                rest = series[i:]
                if all(upper_bound(x.answer_kl, self.quantile) <= budget for x in rest):
                    out.append(Qualified(p, upper_bound(p.answer_kl, self.quantile), None, p.speedup))
                    continue
                if not all(x.shift for x in rest):
                    continue
                for gate in sorted(set(p.shift), reverse=True):  # the loosest gate first
                    if all(upper_bound(gated(x, gate), self.quantile) <= budget for x in rest):
                        share = sum(d > gate for d in p.shift) / len(p.shift)
                        out.append(Qualified(p, upper_bound(gated(p, gate), self.quantile), gate,
                                             1.0 / (1.0 / p.speedup + share)))
                        break
        return out

    def choose(self, budget: float, context_tokens: int) -> Choice:
        """Of the qualifying settings (``qualifying``), the one expected fastest (a gated setting's measured
        speedup less the full prefills its gate sends, ``Qualified.speedup``), where speeds within
        ``SPEED_TIE`` of the fastest count as a tie that the smaller bound wins; full prefill when none
        qualifies or the fastest is slower than full prefill."""
        band = self.band_for(context_tokens)
        ok = self.qualifying(budget, band)
        fastest = max((q.speedup for q in ok), default=0.0)
        if fastest < 1.0:
            return Choice(ReuseOptions(policy="full"), band.name, 0.0)
        best = min((q for q in ok if q.speedup >= fastest / SPEED_TIE), key=lambda q: (q.bound, -q.speedup))
        return Choice(self.options(best.point), band.name, round(best.bound, 6), best.gate, round(best.speedup, 3))

    def without_first_k(self) -> CalibrationProfile:
        """This profile less its first_k series (a band left with no point resolves to full prefill): for KV
        that was not compiled alone, whose span starts are not the sinks first_k repairs (the connector's
        spans saved in their first request's context)."""
        bands = tuple(replace(b, points=tuple(p for p in b.points if p.first_k is None)) for b in self.bands)
        return replace(self, bands=bands)

    def options(self, point: Point) -> ReuseOptions:
        """The setting a request runs when ``point`` is chosen: first_k alone with its k, or query_attention
        at its ratio and depth, or kv_deviation at its ratio (uncapped, with the profile's sinks)."""
        if point.first_k is not None:
            return ReuseOptions(policy="first_k", ratio=0.0, max_recompute=None, first_k=point.first_k,
                                probe_layers=self.probe_layers)
        return ReuseOptions(policy=point.policy, ratio=point.ratio, max_recompute=None, first_k=self.first_k,
                            probe_layers=self.depth(point))

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "profile") -> CalibrationProfile:
        """Read a profile written by ``to_json``; ``CalibrationError`` names the first field out of range."""
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise CalibrationError(f"{source} cannot be read ({exc}); run `contextkit calibrate` again") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CalibrationError(f"{source} is not a {FORMAT} file; make one with `contextkit calibrate`")
        from contextkit.spans.profile_file import checked_profile  # the file's schema, which builds this class

        return checked_profile({k: v for k, v in raw.items() if k != "format"}, source)

    @classmethod
    def load(cls, path: Path | str, *, model_digest: str, dtype: str, kv_source: str | None = None
             ) -> CalibrationProfile:
        """Read a profile and refuse it unless it was made for these weights and this dtype (and, where
        ``kv_source`` is given, on that KV source)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise CalibrationError(f"calibration profile {path} cannot be read: {exc.strerror}") from None
        profile = cls.from_json(text, str(path))
        least = minimum_prompts(profile.quantile)
        if few := [b.name for b in profile.bands if min(len(p.answer_kl) for p in b.points) < least]:
            log.warning("calibration profile %s has fewer than %d prompts in band(s) %s: no setting can be bounded "
                        "at quantile %s there, so those requests run full prefill; calibrate with --n 24 or more",
                        path, least, ", ".join(few), profile.quantile)
        if profile.model_digest != model_digest:
            raise CalibrationError(
                f"calibration profile {path} was made for other weights (digest {profile.model_digest[:12]}, "
                f"this model is {model_digest[:12]}): it is not used; run `contextkit calibrate` for this model")
        if profile.dtype != dtype:
            raise CalibrationError(
                f"calibration profile {path} was made for {profile.dtype}, this engine runs {dtype}: it is not "
                f"used; run `contextkit calibrate --dtype {dtype}`")
        if kv_source is not None and profile.kv_source != kv_source:
            raise CalibrationError(
                f"calibration profile {path} was measured on {profile.kv_source} span KV, this path reuses "
                f"{kv_source} KV: it is not used; run `contextkit calibrate --set kv_source={kv_source}`")
        here = machine_class()
        if profile.machine and profile.machine != here:
            log.warning("calibration profile %s measured its speedups on %s, this machine is %s: its fidelity "
                        "bounds hold, but which setting is fastest may differ here; re-time them with `contextkit "
                        "calibrate --set speeds_from=%s`", path, profile.machine, here, path)
        return profile


PACKAGED = Path(__file__).resolve().parent / "profiles"  # shipped profiles, named by ``CalibrationProfile.id``


def packaged_profile(model_digest: str, dtype: str, kv_source: str = "compiled") -> Path:
    """Where a profile shipped with contextkit for these weights, dtype and KV source would be
    (``spans/profiles``: made by the commands in docs/benchmarks.md, "Shipped calibration profiles")."""
    return PACKAGED / f"{model_digest[:12]}-{dtype}{_source_suffix(kv_source)}.json"


def find_profile(model_dir: Path | str, *, model_digest: str, dtype: str, explicit: Path | None = None,
                 kv_source: str = "compiled") -> CalibrationProfile | None:
    """The profile for an engine reusing ``kv_source`` KV: ``explicit`` (refused with ``CalibrationError``
    when it does not fit), else the one beside the model for ``dtype`` and ``kv_source`` (``contextkit
    calibrate`` writes it there), else the one shipped with contextkit for these weights, dtype and source
    (a found one that does not fit is ignored with a warning), else None."""
    if explicit is not None:
        return CalibrationProfile.load(explicit, model_digest=model_digest, dtype=dtype, kv_source=kv_source)
    for path in (profile_path(model_dir, dtype, kv_source), packaged_profile(model_digest, dtype, kv_source)):
        if not path.is_file():
            continue
        try:
            return CalibrationProfile.load(path, model_digest=model_digest, dtype=dtype, kv_source=kv_source)
        except CalibrationError as exc:
            log.warning("%s", exc)
    return None
