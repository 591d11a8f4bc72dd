"""`contextkit calibrate` on a tiny set: the profile it writes resolves budgets, and other weights refuse it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from contextkit.core.config import ContextKitConfig, machine_class
from contextkit.core.errors import CalibrationError
from contextkit.core.models import weights_digest
from contextkit.core.policy import ReuseOptions
from contextkit.spans.calibration import CalibrationProfile

pytestmark = pytest.mark.slow  # a subprocess on the real model, then a kit


def test_calibrate_writes_a_profile_the_kit_uses_and_other_weights_refuse(tmp_path, smol_dir, gemma_dir, cli,
                                                                             passage_text):
    profile_file, table = tmp_path / "profile.json", tmp_path / "calibrate.json"
    proc = cli("calibrate", "--n", "1", "--dtype", "float32", "--out", str(profile_file), "--json", str(table),
               "--set", "bands=1.5k", "--set", "ratios=0,0.3", "--set", "first_k=8", "--set", "answer_tokens=4",
               "--set", "split=all", "--set", "quantile=0.5",  # one prompt bounds a median (a 90% quantile needs 9)
               timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "profile written to" in proc.stderr
    result = json.loads(table.read_text())
    # each ratio at both probe depths (8 layers, all), except ratio 0, which runs no probe; then first_k alone
    assert [(r["band"], r["policy"], r["probe_layers"], r["ratio"], r["first_k"]) for r in result["rows"]] == [
        ("1.5k", "query_attention", 8, 0.0, None), ("1.5k", "query_attention", 8, 0.3, None),
        ("1.5k", "query_attention", 0, 0.3, None), ("1.5k", "first_k", None, 0.0, 8)]
    assert all(r["answer_kl_p90"] >= 0 and 0 <= r["tf_agreement"] <= 1 for r in result["rows"])

    digest = weights_digest(smol_dir)
    profile = CalibrationProfile.load(profile_file, model_digest=digest, dtype="float32")
    assert profile.id == f"{digest[:12]}-float32" and profile.bands[0].name == "1.5k"
    assert len(profile.bands[0].points[0].answer_kl) == 1
    # the recompute's key shift per prompt, the tail gate's signal (ratio 0 recomputes the sinks)
    assert [len(p.shift) for p in profile.bands[0].points] == [1, 1, 1, 1]
    assert [p.first_k for p in profile.bands[0].points] == [None, None, None, 8]
    assert all(d > 0 for p in profile.bands[0].points for d in p.shift)
    assert profile.machine == machine_class()  # where its speedups were measured

    # re-timed on "another machine": the fidelity kept, the speedups measured again, this machine recorded
    moved = dataclasses.replace(profile, machine="elsewhere/avx2/64c")
    profile_file.write_text(moved.to_json())
    retimed_file = tmp_path / "retimed.json"
    proc = cli("calibrate", "--n", "1", "--dtype", "float32", "--set", f"speeds_from={profile_file}", "--set",
               f"out={retimed_file}", "--set", "split=all", timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "elsewhere/avx2/64c" in proc.stderr and "speeds_from" in proc.stderr  # the load's warning
    retimed = CalibrationProfile.load(retimed_file, model_digest=digest, dtype="float32")
    assert retimed.machine == machine_class()
    for before, after in zip(profile.bands[0].points, retimed.bands[0].points):
        assert (after.ratio, after.first_k, after.answer_kl, after.shift) == (
            before.ratio, before.first_k, before.answer_kl, before.shift)
        assert after.speedup > 0
    # a short band added to that profile, its 1.5k band kept as measured; a profile measured on another
    # machine class (or with other settings) refuses it before anything is measured
    merged_file = tmp_path / "merged.json"
    short = ("--n", "1", "--dtype", "float32", "--set", "bands=0.25k", "--set", "ratios=0,0.3", "--set",
             "first_k=", "--set", "answer_tokens=4", "--set", "split=all", "--set", "quantile=0.5")
    proc = cli("calibrate", *short, "--set", f"add_to={retimed_file}", "--set", f"out={merged_file}", timeout=900)
    assert proc.returncode == 0, proc.stderr
    merged = CalibrationProfile.load(merged_file, model_digest=digest, dtype="float32")
    assert [b.name for b in merged.bands] == ["0.25k", "1.5k"] and merged.bands[1] == retimed.bands[0]
    assert 150 <= merged.bands[0].context_tokens <= 400 and "0.25k" in merged.data
    assert merged.band_for(120).name == "0.25k" and merged.band_for(1400).name == "1.5k"
    proc = cli("calibrate", *short, "--set", f"add_to={profile_file}", "--set", f"out={tmp_path / 'no.json'}")
    assert proc.returncode == 2 and "elsewhere/avx2/64c" in proc.stderr and not (tmp_path / "no.json").exists()
    # spans saved out of another request's context (what vLLM's connector loads), with kv_deviation's series:
    # a profile of its own (its id says so), refused where spans compiled alone are reused
    ctx_file = tmp_path / "context.json"
    proc = cli("calibrate", "--n", "1", "--dtype", "float32", "--out", str(ctx_file), "--json", str(table),
               "--set", "bands=0.25k", "--set", "ratios=0", "--set", "kv_source=context", "--set", "kv_deviation=0.3",
               "--set", "answer_tokens=4", "--set", "split=all", "--set", "quantile=0.5", timeout=900)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(table.read_text())["rows"]
    assert [(r["policy"], r["ratio"], r["first_k"], r["probe_layers"]) for r in rows] == [
        ("query_attention", 0.0, None, 8), ("kv_deviation", 0.3, None, None)]
    own = CalibrationProfile.load(ctx_file, model_digest=digest, dtype="float32", kv_source="context")
    assert own.id == f"{digest[:12]}-float32-context" and own.series(own.bands[0].points[1]) == ("kv_deviation", 0)
    assert own.options(own.bands[0].points[1]).policy == "kv_deviation"
    with pytest.raises(CalibrationError, match="kv_source=compiled"):
        CalibrationProfile.load(ctx_file, model_digest=digest, dtype="float32", kv_source="compiled")
    # another model's weights, or the same weights in another dtype: refused, never used
    with pytest.raises(CalibrationError, match="other weights"):
        CalibrationProfile.load(profile_file, model_digest=weights_digest(gemma_dir), dtype="float32")
    with pytest.raises(CalibrationError, match="bfloat16"):
        CalibrationProfile.load(profile_file, model_digest=digest, dtype="bfloat16")

    # a kit given the profile resolves the default budget with it and says so in the report
    from contextkit.core.types import Evidence
    from contextkit.kit import ContextKit

    kit = ContextKit(ContextKitConfig(model=str(smol_dir), dtype="float32", calibration=profile_file,
                                      cache_dir=tmp_path / "cache"))
    try:
        docs = [Evidence(b, id=f"p{i}") for i, b in enumerate(passage_text.split("\n\n")[:3]) if b.strip()]
        gen = kit.generate("Who was born first?", docs, reuse=ReuseOptions(fidelity_budget=1.0))
        assert gen.reuse.profile == profile.id and gen.reuse.band == "1.5k" and gen.reuse.fidelity_budget == 1.0
        # a budget every calibrated setting meets: the one measured fastest, unless it measured slower than
        # full prefill (then full prefill, exact and faster)
        chosen = profile.choose(1.0, 1500).options
        fastest = max(profile.bands[0].points, key=lambda p: p.speedup)
        want = "full" if fastest.speedup < 1 else profile.options(fastest).policy
        assert gen.reuse.policy == chosen.policy == want
        if chosen.policy != "full":
            assert gen.reuse.ratio == chosen.ratio == fastest.ratio
    finally:
        kit.close()
    with pytest.raises(CalibrationError, match="other weights"):
        ContextKit(dataclasses.replace(ContextKitConfig(model=str(gemma_dir), dtype="float32",
                                                        cache_dir=tmp_path / "cache"), calibration=profile_file))


def test_calibrate_refuses_too_few_prompts_to_bound_its_quantile(tmp_path, cli, one_line_error):
    one_line_error(cli("calibrate", "--n", "4", "--out", str(tmp_path / "p.json"), timeout=300),
                   "at least 9 prompts", "--n 24")
    assert not (tmp_path / "p.json").exists()


def test_calibrate_without_data_outside_a_checkout_says_to_pass_data(tmp_path, cli, one_line_error):
    """Outside a checkout (no shared dev file beside it) calibrate used to fall back to the one bundled example
    question and fail on "too few questions"; it now says what data it needs."""
    one_line_error(cli("calibrate", "--out", str(tmp_path / "p.json"), cwd=tmp_path, timeout=300),
                   "--data FILE", "multihop_dev.jsonl")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("setting, hint", [("ratios=0.1,1.5", "numbers in [0, 1]"),
                                           ("probe_layers=-1", "layer counts >= 0"),
                                           ("first_k=0,16", "token counts >= 1"),
                                           ("kv_deviation=0,0.2", "ratios in (0, 1]"),
                                           ("kv_source=vllm", "compiled, context")])
def test_calibrate_refuses_a_bad_list_naming_what_to_give(tmp_path, cli, one_line_error, setting, hint):
    one_line_error(cli("calibrate", "--set", setting, "--out", str(tmp_path / "p.json"), timeout=300),
                   f"--set {setting.split('=')[0]}=", hint)
    assert not (tmp_path / "p.json").exists()
