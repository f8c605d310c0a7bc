"""Write constraints.txt from the packages installed in a virtual environment.

``make upgrade-constraints`` runs this on a throwaway environment that installed moeshard's test
and lint extras with no constraints, i.e. the current releases; the result pins every package
that ``make check``, ``make test`` and ``make lint`` install, so CI resolves the same versions
until the file is re-resolved by a deliberate commit.

    python3 scripts/freeze_constraints.py VENV_PYTHON constraints.txt
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HEADER = """\
# The exact versions `make check`, `make test` and `make lint` install (pip -c constraints.txt).
# moeshard's own dependencies stay ranges in pyproject.toml; this file pins what CI resolves.
# Written by `make upgrade-constraints` (scripts/freeze_constraints.py), which re-resolves every
# package to its current release on Python {python} and runs lint and the suite with the result:
# commit the new file only if both pass.
# torch is the CPU build (torch==2.13.0 on this kind of machine; `TORCH=...` in the Makefile).
"""


def frozen(python: str) -> list[str]:
    """`pip freeze` of that interpreter, without moeshard itself; local labels dropped
    (``torch==2.13.0+cpu`` -> ``torch==2.13.0``: a constraint without a label matches the build)."""
    out = subprocess.run([python, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    lines = []
    for line in out.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-e ")) or " @ " in line:
            continue
        name, _, version = line.partition("==")
        if name.lower() in ("moeshard", "setuptools", "wheel"):
            continue
        lines.append(f"{name}=={re.sub(r'[+].*$', '', version)}")
    return sorted(lines, key=str.lower)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: freeze_constraints.py VENV_PYTHON OUTPUT", file=sys.stderr)
        return 2
    python, output = argv
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], check=True,
                             capture_output=True, text=True).stdout.strip()
    text = HEADER.format(python=version) + "\n".join(frozen(python)) + "\n"
    target = Path(output)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, target)
    print(f"wrote {target} ({text.count(chr(10)) - HEADER.count(chr(10))} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
