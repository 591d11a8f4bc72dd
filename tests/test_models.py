"""Model preparation: offline, keyed by the source's sha256, reused, and loud about damaged files."""

from __future__ import annotations

import json
import shutil

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


def test_unknown_model_lists_known_names():
    with pytest.raises(ModelNotFoundError) as exc:
        resolve("llama-70b")
    assert "smollm2-135m-instruct" in str(exc.value) and "gemma3-270m" in str(exc.value)


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


@pytest.mark.slow  # converts the default model from its GGUF, twice
def test_stale_partial_directory_is_replaced(tmp_path, smol_dir):
    # A directory without a manifest (e.g. a crash mid-copy by an older version) is rebuilt, not used.
    src = REGISTRY["smollm2-135m-instruct"].gguf_files()[0]
    own = tmp_path / "own.gguf"
    shutil.copy(src, own)
    first = prepare("own", tmp_path, gguf=own)
    (first / "contextkit.json").unlink()
    (first / "model.safetensors").write_bytes(b"partial")
    again = prepare("own", tmp_path, gguf=own)
    assert again == first and (again / "contextkit.json").is_file()
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
