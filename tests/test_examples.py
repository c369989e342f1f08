"""The examples run as a user runs them: the notebook executed by nbclient in a real
kernel, twice (the second execution is the kernel restart), and the demo script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

import overmind_lab
from overmind_lab import Client

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

REPO = Path(overmind_lab.__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


@pytest.fixture
def example_env(daemon: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Kernels and scripts started from here find the package, the test daemon and a tiny
    model directory."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("OVERMIND_LAB_EXAMPLE_TINY", "1")
    monkeypatch.setenv("OVERMIND_LAB_EXAMPLE_MODELS", str(tmp_path / "models"))
    return tmp_path / "models"


def execute(path: Path) -> dict[str, Any]:
    """Run the notebook in a new kernel; return its cells by tag."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return {cell.metadata["tags"][0]: cell for cell in nb.cells if cell.metadata.get("tags")}


def stdout(cell: Any) -> list[str]:
    text = "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and o.name == "stdout")
    return [line for line in text.splitlines() if line.strip()]


def test_the_notebook_runs_and_is_warm_after_a_kernel_restart(example_env: Path,
                                                             daemon: Client) -> None:
    first = execute(EXAMPLES / "cold_vs_warm.ipynb")

    assert stdout(first["patch"])[0].startswith("overmind-lab: from_pretrained of diffusers")
    cold = stdout(first["timeit-cold"])
    assert sum("(cache bypassed)" in line for line in cold) == 3
    assert "per loop" in cold[-1]
    cached = stdout(first["timeit-cached"])
    assert cached[0].startswith("cold ") and cached[0].endswith(
        f"StableDiffusionPipeline.from_pretrained({str(example_env / 'sd15-tiny-float16')!r})")
    assert [line.split()[0] for line in cached[1:3]] == ["warm", "warm"]

    second = execute(EXAMPLES / "cold_vs_warm.ipynb")  # a new kernel: the restart

    cached = stdout(second["timeit-cached"])
    assert [line.split()[0] for line in cached[:3]] == ["warm"] * 3
    [restart_load] = stdout(second["restart-load"])
    assert restart_load.startswith("warm ") and "(cold load was " in restart_load
    # copy-on-write: the kernel's write did not reach the cache
    mine, fresh = stdout(second["isolation"])
    assert mine == "this kernel's conv_in: 0.0"
    assert float(fresh.rsplit(" ", 1)[1]) > 0
    [status] = [o for o in second["status"].outputs if o.output_type == "execute_result"]
    assert "<table>" in status.data["text/html"]
    assert "StableDiffusionPipeline.from_pretrained(" in status.data["text/plain"]
    [panel] = [o for o in second["widget"].outputs if o.output_type == "execute_result"]
    assert "application/vnd.jupyter.widget-view+json" in panel.data
    assert len(daemon.entries()) == 1


def test_the_demo_prints_cold_then_warm(example_env: Path, daemon: Client) -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / "demo.py"), "--tiny",
         "--models", str(example_env)],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "PYTHONWARNINGS": "error"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("process "))
    assert out[header].split() == ["process", "load", "imports", "from_pretrained", "vs",
                                   "plain", "load", "process", "RSS", "daemon", "holds"]
    first, second = out[header + 2].split(), out[header + 3].split()
    assert first[:3] == ["first", "kernel", "cold"]
    assert second[:4] == ["after", "a", "restart", "warm"]
    assert "x faster" in out[header + 3]
    assert first[-2:] == second[-2:]  # the daemon stored nothing in the warm run
    assert any("jupyter lab" in line and "cold_vs_warm.ipynb" in line for line in out)
    assert any("warm kernel" in line for line in out)  # installed, or how to install it


def test_the_notebook_asks_for_the_warm_kernel() -> None:
    nb = nbformat.read(EXAMPLES / "cold_vs_warm.ipynb", as_version=4)
    assert nb.metadata.kernelspec.name == "overmind-lab-warm"
    assert nb.metadata.kernelspec.language == "python"
