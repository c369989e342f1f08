"""Browser tests of the JupyterLab sidebar: real JupyterLab, kernels, daemon and chromium.

This starts a daemon on a temporary socket and ``jupyter lab`` under the non-root base URL
``/lab-test/`` with the extension from this tree (``overmind_lab/labextension``, built by
``jlpm build``), then runs the Playwright suite in ``ui-tests/`` against it. The server
also sees the warm kernelspec: the browser's first warm kernel starts a zygote (the default
preload set: torch, diffusers, transformers...) beside the daemon socket, the second is
forked from it, and the sidebar lists the zygote and restarts it; every zygote process
(and kernel forked from one) is killed at teardown, also on failure. Screenshots (light and dark) land in
``$OVERMIND_UI_ARTIFACTS``, default ``ui-tests/artifacts/`` (``make images`` copies one
into ``docs/images/``).

Needs Debian's chromium (``apt-get install chromium``), the Playwright package
(``cd ui-tests && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 jlpm install``) and a built
labextension. Without them the test is skipped, saying what is missing; with
``OVERMIND_LAB_REQUIRE_UI=1`` (CI) it fails instead.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overmind_lab import Client
from overmind_lab._jupyter_server import kernelspec as spec
from tests.conftest import save_tiny_unet
from tests.test_warm_kernel import _kill_ours

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

REPO = Path(__file__).resolve().parents[1]
UI_TESTS = REPO / "ui-tests"
LABEXTENSION = REPO / "overmind_lab" / "labextension"
CHROMIUM = os.environ.get("OVERMIND_UI_CHROMIUM", "/usr/bin/chromium")
BASE_URL = "/lab-test/"

LOAD_CELLS = [
    "%load_ext overmind_lab",
    "from diffusers import UNet2DConditionModel",
    '%overmind_load unet = UNet2DConditionModel.from_pretrained("models/unet")',
    'print("LOADED", type(unet).__name__)',
]
CHANGE_CELLS = [
    "import torch\nfrom diffusers import UNet2DConditionModel",
    (
        "torch.manual_seed(7)\n"
        'config = UNet2DConditionModel.load_config("models/unet")\n'
        'UNet2DConditionModel.from_config(config).save_pretrained("models/unet")\n'
        'print("CHANGED")'
    ),
]


STOP_CELLS = ["from overmind_lab import Client", 'print("STOPPED", Client().stop())']
WARM_CELLS = ['import os\nprint("WARM", os.getpid())']


def missing_prerequisites() -> list[str]:
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (apt-get install -y chromium)")
    if not (UI_TESTS / "node_modules" / "@playwright" / "test").is_dir():
        missing.append(
            "ui-tests/node_modules (cd ui-tests && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 jlpm install)"
        )
    if not (LABEXTENSION / "package.json").is_file():
        missing.append("overmind_lab/labextension (jlpm install && jlpm build)")
    if shutil.which("node") is None:
        missing.append("node")
    return missing


def write_notebook(path: Path, cells: list[str], kernel: str = "python3",
                   display_name: str = "Python 3") -> None:
    notebook = {
        "cells": [
            {"cell_type": "code", "execution_count": None, "id": f"cell{i}", "metadata": {},
             "outputs": [], "source": source}
            for i, source in enumerate(cells)
        ],
        "metadata": {
            "kernelspec": {"display_name": display_name, "language": "python", "name": kernel},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(notebook, indent=1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_up(url: str, proc: subprocess.Popen[bytes], log: Path,
                  timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"jupyter lab exited ({proc.returncode}):\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"jupyter lab did not answer on {url}:\n{log.read_text()}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the server shuts its kernels down
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def prerequisites() -> None:
    """Skip (fail with ``OVERMIND_LAB_REQUIRE_UI=1``) when the browser test cannot run."""
    missing = missing_prerequisites()
    if missing:
        message = "browser tests need: " + "; ".join(missing)
        if os.environ.get("OVERMIND_LAB_REQUIRE_UI") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def zygote(prerequisites: None, sock_path: Path, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The warm kernelspec where the server finds it (``JUPYTER_PATH``); the directory in
    which its first launch starts the zygote (beside the daemon socket). At teardown every
    zygote process is killed: the zygote, its replacement after a restart and the kernels
    forked from them all carry the zygote's socket path in their command line."""
    prefix = tmp_path / "prefix"
    spec.install(prefix=str(prefix))
    share = str(prefix / "share" / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(
        filter(None, [share, os.environ.get("JUPYTER_PATH")])))
    try:
        yield sock_path.parent
    finally:
        _kill_ours(f"{sock_path.parent}/zygote-")


@pytest.fixture
def lab(prerequisites: None, tmp_path: Path, daemon: Client,
        zygote: Path) -> Iterator[dict[str, Any]]:
    """A running ``jupyter lab`` whose kernels use ``daemon``; its URL, token and log."""
    root = tmp_path / "root"
    save_tiny_unet(root / "models" / "unet")
    write_notebook(root / "load.ipynb", LOAD_CELLS)
    write_notebook(root / "again.ipynb", LOAD_CELLS)
    write_notebook(root / "change.ipynb", CHANGE_CELLS)
    write_notebook(root / "stop.ipynb", STOP_CELLS)
    for name in ("warm.ipynb", "warm-again.ipynb"):
        write_notebook(root / name, WARM_CELLS, spec.DEFAULT_NAME, spec.DISPLAY_NAME)

    # This tree's build of the extension, whatever is installed in the environment.
    extensions = tmp_path / "labextensions"
    extensions.mkdir()
    (extensions / "overmind-lab").symlink_to(LABEXTENSION)
    config = tmp_path / "config"
    config.mkdir()
    (config / "jupyter_server_config.json").write_text(json.dumps({
        "ServerApp": {"jpserver_extensions": {"overmind_lab._jupyter_server": True}},
    }))
    # No "receive Jupyter news?" toast over the screenshots.
    (config / "labconfig").mkdir()
    (config / "labconfig" / "page_config.json").write_text(json.dumps({
        "disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True},
    }))

    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    env.update({
        "JUPYTER_CONFIG_DIR": str(config),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        # OVERMIND_LAB_SOCKET comes from the sock_path fixture: kernels inherit it.
    })
    log = tmp_path / "lab.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--allow-root", "--no-browser",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
             f"--ServerApp.base_url={BASE_URL}", f"--ServerApp.root_dir={root}",
             f"--LabApp.extra_labextensions_path={extensions}",
             "--LabApp.expose_app_in_browser=True"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            cwd=root)
    try:
        url = f"http://127.0.0.1:{port}{BASE_URL}"
        wait_until_up(f"{url}api/status?token={token}", proc, log)
        yield {"url": url, "token": token, "log": log, "root": root}
    finally:
        stop(proc)


@pytest.mark.usefixtures("resaves_refreshed")
def test_sidebar_in_a_real_browser(lab: dict[str, Any], daemon: Client, zygote: Path) -> None:
    artifacts = Path(os.environ.get("OVERMIND_UI_ARTIFACTS") or UI_TESTS / "artifacts")
    env = dict(os.environ)
    env.update({
        "OVERMIND_UI_URL": lab["url"],
        "OVERMIND_UI_TOKEN": lab["token"],
        "OVERMIND_UI_ARTIFACTS": str(artifacts),
        "OVERMIND_UI_CHROMIUM": CHROMIUM,
        "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1",
    })
    playwright = UI_TESTS / "node_modules" / ".bin" / "playwright"
    proc = subprocess.run([str(playwright), "test"], check=False, cwd=UI_TESTS, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=900)
    report = f"{proc.stdout}\n{proc.stderr}"
    artifacts.mkdir(exist_ok=True)
    (artifacts / "playwright.log").write_text(report)
    assert proc.returncode == 0, (
        f"playwright failed:\n{report[-12000:]}\n--- jupyter lab log (tail) ---\n"
        f"{lab['log'].read_text()[-4000:]}")
    for name in ("light", "dark", "empty-light", "refreshed-light", "down-light"):
        assert (artifacts / f"sidebar-{name}.png").is_file()
    assert (artifacts / "readme-sidebar.png").is_file()
    # The browser started a zygote through a warm kernel and restarted it: a replacement
    # serves, which has forked nothing yet.
    assert [z["forks"] for z in spec.zygotes(zygote)] == [0]
    # The browser stopped the daemon from a kernel and started it again from the sidebar.
    assert daemon.status()["running"] is True
    assert daemon.entries() == []
