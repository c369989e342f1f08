"""The start of ``overmind-lab run`` (Note [A plain run at once] in ``_launcher/run.py``): what it
imports before a plain ``exec``, and the socket path it computes without ``pathlib`` or
``tempfile``, against the one the zygote client computes.

The import checks run the command with ``-X importtime``: the flag does not pass to the
interpreter that ``run`` execs (``sys.executable`` and the script), so every line on stderr is
the ``run`` process's own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overmind_lab._common.zygote_identity import identity, socket_folder_at_once
from overmind_lab._common.zygote_paths import zygote_dir

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

#: Modules the run process may import before a plain exec beyond the interpreter's own start:
#: ours, and the built-in SHA-256.
ALLOWED = re.compile(r"^(overmind_lab(\..*)?|__future__|_sha256|_sha2)$")


def _imported(stderr: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^import time:.*\|\s*(\S.*)$", stderr, re.M)]


def _baseline(env: dict[str, str], cwd: Path) -> set[str]:
    """What ``python -X importtime -m hello`` imports: the interpreter's start (``site``) and
    ``runpy``'s, as ``python -m overmind_lab`` has them."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "hello"], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True)
    return set(_imported(out.stderr))


@pytest.mark.parametrize("how", [["--plain"], []], ids=["--plain", "no-zygote"])
def test_a_plain_run_imports_next_to_nothing(tmp_path: Path, how: list[str]) -> None:
    # A folder nobody should trust (anyone may write it): the socket lookup says "no zygote" and
    # the grandchild starts none there (``start_for_next`` checks the folder).
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERMIND_LAB_")}
    env["OVERMIND_LAB_SOCKET"] = str(shared / "d.sock")
    (tmp_path / "hello.py").write_text("import sys\nprint('hello', sys.argv[1:])\n")
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "overmind_lab", "run", *how,
                          "hello.py", "x"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "hello ['x']\n"), out.stderr
    extra = [m for m in _imported(out.stderr) if m not in _baseline(env, tmp_path)]
    assert extra and all(ALLOWED.match(m) for m in extra), extra
    # what the grandchild imports goes to /dev/null: nothing else reached the caller's stderr
    assert all(line.startswith("import time:") for line in out.stderr.splitlines()), out.stderr


#: Values of the variables the socket folder depends on, ``None``: unset.
_SOCKETS = st.one_of(st.none(), st.sampled_from([
    "/tmp/a/d.sock", "/tmp//a///d.sock", "/d.sock", "/tmp/a/./d.sock", "/tmp/a/../d.sock",
    "rel/d.sock", "d.sock", "/tmp/a/", "/tmp/a b/ü.sock"]))
_DIRS = st.one_of(st.none(), st.just(""), st.sampled_from(["/tmp", "/nonexistent-xyz"]))


@settings(max_examples=150, deadline=None)
@given(sock=_SOCKETS, xdg=_DIRS, tmpdir=_DIRS)
def test_the_socket_folder_at_once_is_the_clients(sock: str | None, xdg: str | None,
                                                  tmpdir: str | None) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OVERMIND_LAB_SOCKET", "XDG_RUNTIME_DIR", "TMPDIR", "TEMP", "TMP")}
    for name, value in (("OVERMIND_LAB_SOCKET", sock), ("XDG_RUNTIME_DIR", xdg),
                        ("TMPDIR", tmpdir)):
        if value is not None:
            env[name] = value
    quick = socket_folder_at_once(env)
    saved = dict(os.environ)
    import tempfile
    try:  # ``runtime_dir`` reads the process's environment (and tempfile caches its choice)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None
        slow = zygote_dir(env, create=False)  # (``ZygotePaths.for_launch`` with no mkdir)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        tempfile.tempdir = None
    if quick is not None:  # where not certain, ``run`` asks the client: any answer is right
        assert quick == str(slow)


def test_the_identity_follows_what_imports_depend_on() -> None:
    base = {"PATH": "/bin", "HOME": "/h", "OMP_NUM_THREADS": "2"}
    same = [identity(sys.executable, base),
            identity(sys.executable, {**base, "PATH": "/usr/bin", "TERM": "x"}),
            identity(sys.executable, {**base, "OVERMIND_LAB_ZYGOTE_IDLE": "9"})]
    assert len(set(same)) == 1 and re.fullmatch(r"[0-9a-f]{16}", same[0])
    differ = {identity(sys.executable, {**base, "OMP_NUM_THREADS": "3"}),
              identity(sys.executable, {**base, "HOME": "/g"}),
              identity(sys.executable, {**base, "HF_HOME": "/x"}),
              identity(sys.executable, {**base, "LANG": "C"}), same[0]}
    assert len(differ) == 5
