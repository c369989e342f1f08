"""Shared fixtures: a real daemon on a temporary socket, real separate Python processes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overmind_lab import Client

# Zygotes exit with their last owner in tests (Note [Idle zygote]: the default idle time
# would keep every test's zygote alive for minutes); tests of the idle time set their own.
os.environ.setdefault("OVERMIND_LAB_ZYGOTE_IDLE", "0")
# Note [A daemon that does not answer]: 2 s is the default deadline for a daemon's first reply. The
# suite runs beside CPU burners, where a healthy daemon may be slower; a test that a silent daemon
# is given up on sets its own deadline (tests/test_trust.py).
os.environ.setdefault("OVERMIND_LAB_ANSWER_TIMEOUT", "10")
# Note [A daemon started ahead]: ``patch_all()`` starts the user's daemon in the background; a
# test that patches without a daemon of its own would leave one running. Tests of it turn it on.
os.environ.setdefault("OVERMIND_LAB_START_AHEAD", "0")

#: Every socket path a test used: the session-end check looks for daemons still serving one.
_SOCKETS: list[Path] = []


def _daemons_on(path: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"overmind_lab(\\._daemon)? serve .*--socket {path}( |$)"],
                         capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a daemon that a test started on one of its sockets is still alive."""
    leaked = {str(p): pids for p in _SOCKETS if (pids := _daemons_on(p))}
    if leaked:
        for pids in leaked.values():
            for pid in pids:  # ours: started on a socket path this session made
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        print(f"\nleaked overmind-lab daemons (stopped now): {leaked}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def sock_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private socket path (short: Unix sockets allow 108 bytes), set for children too,
    and a private cache directory beside it (``OVERMIND_LAB_CACHE_DIR``).

    Any daemon started on it is stopped at teardown.
    """
    with tempfile.TemporaryDirectory(prefix="olt-", dir="/tmp") as d:
        path = Path(d) / "d.sock"
        _SOCKETS.append(path)
        monkeypatch.setenv("OVERMIND_LAB_SOCKET", str(path))
        monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(Path(d) / "cache"))
        yield path
        stopped = Client(path).stop()
        log = path.with_name(path.name + ".log")
        if log.exists():  # pytest shows a teardown's stderr only when the test failed
            print(f"--- daemon log {log} ---\n{log.read_text(errors='replace')[-6000:]}",
                  file=sys.stderr)
        if not stopped and (pids := _daemons_on(path)):
            for pid in pids:  # wedged: it did not answer "stop"
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the daemon on {path} (pids {pids}) did not answer stop")


@pytest.fixture
def resaves_refreshed(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a test that re-saves a cached model and then refreshes its entry (as a user clicks
    the sidebar's button): the daemon it starts checks its held files once an hour, so the
    check (Note [Sources let go] in the daemon's server) cannot let go of the entry between
    the save and the click. Ask for it before ``daemon``."""
    monkeypatch.setenv("OVERMIND_LAB_DAEMON_SOURCE_CHECK", "3600")


@pytest.fixture
def daemon(sock_path: Path) -> Iterator[Client]:
    """A running daemon on ``sock_path``."""
    client = Client(sock_path)
    client.start()
    yield client


def run_py(code: str, *, env: dict[str, str] | None = None, timeout: float = 180,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (warnings are errors unless the code says)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd="/")
    if check and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_cell(kc: Any, code: str, timeout: float) -> str:
    """Run ``code`` (dedented) in the kernel of the blocking client ``kc``; returns what it
    printed, and fails the test with the traceback if the cell raised."""
    out: list[str] = []
    errors: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "error":
            errors.append("\n".join(content["traceback"]))

    reply = kc.execute_interactive(textwrap.dedent(code), timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", "\n".join(errors)
    return "".join(out)


def start_busy_cell(kc: Any, code: str, timeout: float) -> str:
    """Send ``print('looping', flush=True)`` then ``code``; return its msg_id once that output
    arrived: the cell's own code runs, so an interrupt lands in it (at its execute_input one can
    come before the cell's code, and ipykernel then sometimes never replies to the cell, plain
    kernels too). ``stop_on_error=False``: ipykernel would abort the requests that follow a
    KeyboardInterrupt for a while."""
    msg_id: str = kc.execute("print('looping', flush=True)\n" + code, stop_on_error=False)
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream"
                and "looping" in msg["content"]["text"]):
            return msg_id


def wait_for_exit(pid: int, timeout: float = 60, what: str = "") -> None:
    """Return once ``pid`` exited (its pidfd readable: its descriptors and sockets are closed by
    then), also when it is not our child; fail after ``timeout`` s."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], timeout)[0], f"{what or pid} did not exit"
    finally:
        os.close(fd)


def kill_and_wait(pid: int) -> None:
    """SIGKILL ``pid`` (through its pidfd: never a reused pid) and wait for its exit."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)
    wait_for_exit(pid)


def last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    """The last stdout line of a child, parsed as JSON."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_unet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real diffusers UNet2DConditionModel (tiny config, random weights) on disk."""
    return save_tiny_unet(tmp_path_factory.mktemp("unet"))


def save_tiny_unet(path: Path, seed: int = 0) -> Path:
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), cross_attention_dim=32, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8,
    )
    model.save_pretrained(path)
    return path


def is_open(fd: int) -> bool:
    """Whether ``fd`` is an open descriptor of this process."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB ext4 file system, loop-mounted (root only)."""
    if os.getuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("a small file system needs root and mkfs.ext4 (loop mount)")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True, timeout=60)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)],
                             capture_output=True, text=True, timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=60)


def pip_install_project(project: Path, name: str, prefix: Path, *, editable: bool,
                        timeout: float = 300) -> Path:
    """Write ``project``'s ``pyproject.toml`` (setuptools, version 0.1) and ``pip install`` it
    offline into ``prefix`` (again: a reinstall); returns its site-packages folder."""
    (project / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{name}"
        version = "0.1"
    """))
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", "--force-reinstall",
         "--prefix", str(prefix), *(["-e"] if editable else []), str(project)],
        capture_output=True, text=True, timeout=timeout, cwd=project.parent)
    assert pip.returncode == 0, pip.stderr
    [site_dir] = prefix.glob("lib/python*/site-packages")
    return site_dir


#: A Llama small enough to save and load in well under a second (random weights).
TINY_LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


def save_tiny_llama(path: Path, **config: Any) -> Path:
    """A ``LlamaForCausalLM`` of :data:`TINY_LLAMA` (``config`` overrides) saved at ``path``,
    seeded (the same weights each time)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **config})).save_pretrained(path)
    return path
