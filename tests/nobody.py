"""Running a client as another user (uid 65534) from a checkout it may not be able to read.

The checkout, its virtualenv or the interpreter may lie in a 0700 folder (a ``mktemp -d``
folder, root's home): uid 65534 then can run neither our interpreter nor import our
package from there. These helpers find an interpreter it can run and give it a
world-readable copy of the package's Python files (the client side needs nothing else).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import overmind_lab

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def python_for_nobody() -> str | None:
    """An interpreter uid 65534 can run, or ``None``."""
    for python in (os.path.realpath(sys._base_executable), "/usr/bin/python3"):
        probe = subprocess.run([*NOBODY, python, "-c", "print('ok')"], capture_output=True,
                               text=True, timeout=60)
        if probe.stdout.strip() == "ok":
            return python
    return None


@contextmanager
def package_for_nobody() -> Iterator[str]:
    """A folder uid 65534 can read holding a copy of the ``overmind_lab`` Python files."""
    with tempfile.TemporaryDirectory(prefix="olt-nobody-", dir="/tmp") as copy:
        os.chmod(copy, 0o755)
        shutil.copytree(Path(overmind_lab.__file__).resolve().parent,
                        Path(copy) / "overmind_lab",
                        ignore=shutil.ignore_patterns("labextension", "__pycache__", "*.so"))
        for path in Path(copy).rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield copy
