"""The notebook loop through a real ipykernel (jupyter_client): load through the magic,
restart the kernel, load again. The second load is warm: the original loader does not run
(a side effect in the model's ``__init__`` proves it), and the weights are equal."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

import overmind_lab
from overmind_lab import Client
from tests.conftest import run_cell

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

REPO = str(Path(overmind_lab.__file__).resolve().parents[1])

COUNTING_MODEL = '''
"""A diffusers model whose constructor leaves a mark: from_pretrained runs it, a warm
load (unpickling) does not."""
import os

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config


class CountingNet(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, width: int = 16):
        super().__init__()
        marks = os.environ.get("OVERMIND_TEST_MARKS")
        if marks:
            with open(marks, "a") as f:
                f.write(f"{os.getpid()}\\n")
        self.proj = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, 4)
'''

DIGEST = '''
import hashlib, json, os

def digest(model):
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode()); h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
'''


def digest_file(path: Path) -> str:
    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(name.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


class Kernel:
    """A thin driver: run a cell, return its stdout, fail on an error."""

    def __init__(self, env: dict[str, str]) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 180) -> str:
        return run_cell(self.kc, code, timeout)

    def restart(self) -> None:
        self.km.restart_kernel(now=False)
        self.kc.wait_for_ready(timeout=120)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    code = tmp_path / "code"
    code.mkdir()
    (code / "counting_model.py").write_text(COUNTING_MODEL)
    sys.path.insert(0, str(code))
    try:
        import torch
        from counting_model import CountingNet  # type: ignore[import-not-found]

        torch.manual_seed(0)
        CountingNet(width=16).save_pretrained(tmp_path / "net")
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("counting_model", None)
    from tests.conftest import save_tiny_unet

    return {"code": code, "net": tmp_path / "net",
            "unet": save_tiny_unet(tmp_path / "unet", seed=1)}


@pytest.fixture
def kernel(daemon: Client, models: dict[str, Path], tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Kernel]:
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    env = dict(os.environ)
    env.update({
        "OVERMIND_LAB_SOCKET": str(daemon.path),
        "OVERMIND_TEST_MARKS": str(tmp_path / "marks"),
        "PYTHONPATH": os.pathsep.join([str(models["code"]), REPO]),
        "HF_HUB_OFFLINE": "1",
    })
    k = Kernel(env)
    yield k
    k.close()


LOAD_CELLS = f"""
%load_ext overmind_lab
%overmind_load --quiet
{DIGEST}
from counting_model import CountingNet
from diffusers import UNet2DConditionModel
%overmind_load net = CountingNet.from_pretrained({{net!r}})
%overmind_load unet = UNet2DConditionModel.from_pretrained({{unet!r}})
print(json.dumps({{{{"pid": os.getpid(), "net": digest(net), "unet": digest(unet)}}}}))
"""


def test_the_load_after_a_kernel_restart_is_warm(
        kernel: Kernel, models: dict[str, Path], tmp_path: Path, daemon: Client) -> None:
    cells = LOAD_CELLS.format(net=str(models["net"]), unet=str(models["unet"]))
    marks = tmp_path / "marks"

    first = kernel.run(cells).splitlines()
    before = json.loads(first[-1])
    assert [line.split()[0] for line in first[:2]] == ["cold", "cold"]
    assert marks.read_text().split() == [str(before["pid"])]  # the original loader ran

    kernel.restart()
    second = kernel.run(cells).splitlines()
    after = json.loads(second[-1])
    assert after["pid"] != before["pid"]  # a new kernel process
    assert second[0].startswith("warm ") and "CountingNet.from_pretrained(" in second[0]
    assert second[1].startswith("warm ") and "UNet2DConditionModel.from_pretrained(" in second[1]
    assert marks.read_text().split() == [str(before["pid"])]  # ...and did not run again

    assert after["net"] == before["net"] == digest_file(
        models["net"] / "diffusion_pytorch_model.safetensors")
    assert after["unet"] == before["unet"] == digest_file(
        models["unet"] / "diffusion_pytorch_model.safetensors")
    assert sorted(e["hits"] for e in daemon.entries()) == [1, 1]


def test_cold_after_a_restart_runs_the_original_loader(
        kernel: Kernel, models: dict[str, Path], tmp_path: Path) -> None:
    """The control: --cold really loads (the mark appears), even with a warm entry."""
    load = f"%overmind_load net = CountingNet.from_pretrained({str(models['net'])!r})"
    setup = "%load_ext overmind_lab\nfrom counting_model import CountingNet\n"
    kernel.run(setup + load)
    kernel.restart()
    out = kernel.run(setup + load.replace("%overmind_load ", "%overmind_load --cold "))
    assert "(cache bypassed)" in out
    assert len((tmp_path / "marks").read_text().split()) == 2


BACKGROUND_LOAD = """
import json, overmind_lab
from overmind_lab._loading.background import pending_stores
from tests.loaders import counting_module
with overmind_lab.record_loads() as events:
    model = overmind_lab.load(counting_module, 4096)
print(json.dumps({"outcome": events[-1].outcome, "storing": [s.pid for s in pending_stores()],
                  "sum": float(model.weight.detach().sum())}))
"""


def test_a_store_under_way_survives_an_interrupt_and_a_kernel_restart(
        daemon: Client, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """jupyter_client interrupts with SIGINT and restarts with SIGKILL, both sent to the
    kernel's process group: a store started by the last cell before a restart (Note
    [Storing in a forked process]) is in a session of its own, and lands."""
    from tests.loaders import PICKLE_GATE_ENV

    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    env = dict(os.environ)
    env.update({"OVERMIND_LAB_SOCKET": str(daemon.path), "PYTHONPATH": REPO,
                "OVERMIND_LAB_BACKGROUND_STORE": "always"})
    gate = tmp_path / "gate"  # the store pickles once it exists: after the restart
    env[PICKLE_GATE_ENV] = str(gate)
    kernel = Kernel(env)
    try:
        first = json.loads(kernel.run(BACKGROUND_LOAD).splitlines()[-1])
        assert first["outcome"] == "cold" and len(first["storing"]) == 1
        assert daemon.entries() == []  # still pickling
        kernel.km.interrupt_kernel()
        kernel.km.restart_kernel(now=True)  # SIGKILL to the kernel's process group
        kernel.kc.wait_for_ready(timeout=120)
        gate.touch()
        second = json.loads(kernel.run(BACKGROUND_LOAD).splitlines()[-1])
    finally:
        gate.touch()  # a failed test leaves no store waiting
        kernel.close()
    # the new kernel's load waited for the store on the key's lease, then hit
    assert second == {"outcome": "warm", "storing": [], "sum": float(sum(range(4096)))}
    assert first["sum"] == second["sum"]
    [entry] = daemon.entries()
    assert entry["hits"] == 1
    child = Path(f"/proc/{first['storing'][0]}")
    deadline = time.monotonic() + 120  # it ends right after its store, and init reaps it
    while child.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child.exists()
