"""``overmind-lab kernel install|status|uninstall`` as a user runs them (subprocesses)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overmind_lab", "kernel", *args],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, check=True)


def test_install_writes_a_kernelspec_that_selects_the_provisioner(tmp_path: Path) -> None:
    env = {"JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "OVERMIND_LAB_SOCKET": str(tmp_path / "run" / "d.sock")}
    out = json.loads(cli("install", "--user", "--json", env=env).stdout)
    spec_dir = Path(out["installed"])
    assert spec_dir == tmp_path / "data" / "kernels" / "overmind-lab-warm"
    spec = json.loads((spec_dir / "kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (warm, overmind-lab)"
    assert spec["argv"] == [sys.executable, "-m", "overmind_lab._launcher", "-f",
                            "{connection_file}"]
    assert spec["metadata"]["kernel_provisioner"]["provisioner_name"] == "overmind-lab-warm"
    assert spec["interrupt_mode"] == "signal"
    # the provisioner is found through its entry point
    from jupyter_client.provisioning import KernelProvisionerFactory

    assert KernelProvisionerFactory.instance()._check_availability("overmind-lab-warm")
    cli("install", "--user", "--name", "other", "--display-name", "Mine", env=env)
    assert json.loads((tmp_path / "data/kernels/other/kernel.json").read_text()
                      )["display_name"] == "Mine"
    assert json.loads(cli("status", "--json", env=env).stdout) == []
    assert "no zygote running" in cli("status", env=env).stdout
    removed = json.loads(cli("uninstall", "--json", env=env).stdout)
    assert removed["removed"] == str(spec_dir) and not spec_dir.exists()
    assert "no kernelspec named" in cli("uninstall", env=env).stdout


def _venv_sharing_this_one(root: Path) -> Path:
    """A second Python environment made from the same interpreter, with this one's
    packages (an editable overmind_lab included) on its path: only the venv differs."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    site_dir = subprocess.run([str(root / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(site_dir, "_overmind_test_shared.pth").write_text(
        f"import site; site.addsitedir({ours!r})\n")
    return root / "bin" / "python"


def _wait_for_socket(path: Path, timeout: float = 300) -> None:
    """Until ``path`` exists (the zygote renames its socket there once its imports are
    done)."""
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no zygote socket {path} after {timeout} s"
        time.sleep(0.05)


def _processes_naming(directory: Path) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(directory).encode() in cmdline:
                out.append(int(entry.name))
    return out


def test_zygotes_belong_to_the_environment_that_made_them(tmp_path: Path) -> None:
    """Two venvs of one interpreter, zygote sockets in one directory, the same variables:
    each has its own zygote (Note [Environments share an interpreter]) and lists and
    restarts only its own."""
    import signal

    from overmind_lab._common.zygote_paths import ZygotePaths, identity

    other = _venv_sharing_this_one(tmp_path / "other-venv")
    run_dir = Path(tempfile.mkdtemp(prefix="olz-", dir="/tmp"))
    env = {**os.environ, "OVERMIND_LAB_SOCKET": str(run_dir / "d.sock"),
           "OVERMIND_LAB_PRELOAD": "json"}  # a zygote that boots in a second
    assert identity(sys.executable, env) != identity(str(other), env)
    spawn = ("import os, sys\n"
             "from overmind_lab._common.zygote_paths import ZygotePaths\n"
             "from overmind_lab._common.zygote_client import spawn\n"
             f"spawn(ZygotePaths.for_launch(sys.executable, os.environ), owners=[{os.getpid()}],"
             " env=dict(os.environ))\n")
    try:
        for python in (sys.executable, str(other)):
            subprocess.run([python, "-c", spawn], env=env, check=True, timeout=120, cwd="/")
            _wait_for_socket(ZygotePaths(run_dir, identity(python, env)).socket)

        def kernel(python: str, *args: str) -> Any:
            return json.loads(subprocess.run(
                [python, "-m", "overmind_lab", "kernel", *args, "--json"], env=env, cwd="/",
                capture_output=True, text=True, timeout=120, check=True).stdout)

        mine, theirs = kernel(sys.executable, "status"), kernel(str(other), "status")
        assert [z["python"] for z in mine] == [sys.executable]
        assert [z["python"] for z in theirs] == [str(other)]
        assert kernel(sys.executable, "restart-zygote")["restarted"] == [mine[0]["pid"]]
        after = kernel(str(other), "status")
        assert [(z["pid"], z["retiring"]) for z in after] == [(theirs[0]["pid"], None)]
    finally:
        for pid in _processes_naming(run_dir):  # the zygotes this test started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_the_preload_report_names_only_modules_a_user_knows(tmp_path: Path) -> None:
    """debugpy's vendored pydevd (on sys.path only once debugpy put it there) is never
    learned, and a learned file written before that rule does not bring it back."""
    learned = tmp_path / "learned.json"
    learned.write_text(json.dumps({"modules": [
        "_pydev_bundle", "_pydev_bundle.pydev_log", "pydevd_plugins", "json", "debugpy"]}))
    code = ("import json, sys\n"
            "import debugpy._vendored.force_pydevd  # puts pydevd on sys.path, imports it\n"
            "from overmind_lab._common import learned as preload\n"
            "mods = preload.third_party_modules()\n"
            "pydev = [m for m in sys.modules if m.startswith('_pydev')]\n"
            f"read = preload.read_learned(__import__('pathlib').Path({str(learned)!r}))\n"
            "print(json.dumps([mods, read, pydev]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True, cwd="/",
                          env={**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
    mods, read, pydev = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(pydev) > 10  # imported, from inside site-packages
    assert "debugpy" in mods and "json" in mods
    assert not [m for m in mods if m.startswith(("_pydev", "pydevd"))]
    assert read == ["json", "debugpy"]
