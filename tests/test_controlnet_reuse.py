"""``vae=vae`` and ``controlnet=[a, b]``: a StableDiffusionControlNetPipeline assembled from
locally saved components (``examples/controlnet_vae_reuse.py``), warm in a new process,
and no tensor stored twice, by the daemon's own byte counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import overmind_lab
from overmind_lab import Client

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

REPO = Path(overmind_lab.__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "controlnet_vae_reuse.py"


def run_example(models: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(SCRIPT), "--tiny", "--dtype", "float32",
         "--json", "--models", str(models)],
        check=False, env=env, capture_output=True, text=True, timeout=600, cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def memfd_tier(sock_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A cache directory on tmpfs: the daemon keeps every segment in a memfd.

    In the file tier, tensors that are unchanged regions of a source file are referenced
    by the held source file, counted whole, so byte counts would not show what was copied; this
    test is about dedup by provenance, which both tiers share. (After ``sock_path``,
    which sets a private cache directory on disk.)
    """
    with tempfile.TemporaryDirectory(prefix="olt-cache-", dir="/dev/shm") as d:
        monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", d)
        yield


def test_components_passed_in_are_cached_once_and_load_warm(memfd_tier: None, daemon: Client,
                                                           tmp_path: Path) -> None:
    assert "memfd" in str(daemon.status().get("tier")), daemon.status()
    first = run_example(tmp_path / "models")
    second = run_example(tmp_path / "models")

    assert first["outcomes"] == ["cold"] * 4
    assert second["outcomes"] == ["warm"] * 4
    assert second["keys"] == first["keys"]

    vae_key, a_key, b_key, pipe_key = first["keys"]
    entries = first["entries"]
    assert entries[pipe_key]["name"].startswith("StableDiffusionControlNetPipeline.")
    # The pipeline's entry refers to the three components by their keys (the example
    # checks that the pipeline holds the very objects passed in, cold and warm)...
    assert entries[pipe_key]["shared_bytes"] == 0
    # ...and its own segment holds the UNet and text encoder plus metadata, which is less
    # than any one component: none of them was copied into it.
    tensors = first["tensor_bytes"]
    extra = entries[pipe_key]["bytes"] - tensors["unet"] - tensors["text_encoder"]
    assert 0 <= extra < min(tensors["vae"], *tensors["controlnets"])
    for key, model in ((vae_key, "vae"), (a_key, 0), (b_key, 1)):
        held = tensors["vae"] if model == "vae" else tensors["controlnets"][model]
        assert held <= entries[key]["bytes"] < held + extra
    # The daemon holds each entry's own bytes once, and the warm run stored nothing.
    assert first["cached_bytes"] == sum(e["bytes"] for e in entries.values())
    assert second["cached_bytes"] == first["cached_bytes"] == daemon.status()["cached_bytes"]
