"""The decoding notebook as a user runs it: executed by nbclient in a real kernel, then the
kernel is restarted (the same kernel manager, a new process) and the notebook runs again.
After the restart the target and the draft come back warm from the test's daemon."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from overmind_lab import Client
from tests.test_decoding import MODELS, REPO, decoding

NOTEBOOK = REPO / "examples" / "decoding" / "speculative.ipynb"
PLOTS = ("plot-acceptance", "plot-exits", "plot-speed")

pytestmark = [pytest.mark.slow,
              pytest.mark.timeout(2400)]  # builds the models when they are missing


@pytest.fixture
def kernel(daemon: Client, monkeypatch: pytest.MonkeyPatch) -> Iterator[KernelManager]:
    decoding.build(MODELS)  # here, not in the notebook's first cell (nbclient's cell timeout)
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                "OVERMIND_LAB_EXAMPLE_MODELS": str(MODELS),
                "OVERMIND_LAB_SOCKET": str(daemon.path)})
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(NOTEBOOK.parent))
    try:
        yield km
    finally:
        km.shutdown_kernel(now=True)


def execute(km: KernelManager) -> dict[str, Any]:
    """Run the notebook in *km*'s kernel (left running); return its cells by tag."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, km=km, timeout=600,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    try:
        client.execute()
    finally:
        if client.kc is not None:  # the kernel is ours (km=): nbclient leaves its channels open
            client.kc.stop_channels()
    return {cell.metadata["tags"][0]: cell for cell in nb.cells if cell.metadata.get("tags")}


def stdout(cell: Any) -> list[str]:
    text = "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and o.name == "stdout")
    return [line for line in text.splitlines() if line.strip()]


def test_the_notebook_runs_every_method_and_is_warm_after_a_restart(
        kernel: KernelManager, daemon: Client) -> None:
    first = execute(kernel)

    loads = stdout(first["load"])
    assert [line.split()[0] for line in loads] == ["cold", "cold"], loads
    assert "AutoModelForCausalLM.from_pretrained(" in loads[0]
    methods = "\n".join(stdout(first["methods"]))
    assert methods.count("(= greedy)") == 4 * 3 and "DIFFERS" not in methods
    side_by_side = stdout(first["transformers"])
    assert [line.split()[0] for line in side_by_side] == ["transformers"] * 4, side_by_side
    assert all(line.endswith("(median; = greedy)") for line in side_by_side), side_by_side
    assert "early exit (threshold" in methods
    sweep = stdout(first["sweep"])
    assert sweep[0].startswith("alpha over all K: ") and len(sweep) == 7
    for tag in PLOTS:
        assert any("image/png" in o.get("data", {}) for o in first[tag].outputs), tag
    assert "layers on average" in stdout(first["plot-exits"])[0]
    pid = kernel.provisioner.pid if kernel.provisioner else None  # type: ignore[attr-defined]

    kernel.restart_kernel(now=False)
    assert kernel.provisioner is not None and kernel.provisioner.pid != pid  # type: ignore[attr-defined]
    second = execute(kernel)

    loads = stdout(second["load"])
    assert [line.split()[0] for line in loads] == ["warm", "warm"], loads
    assert "(cold load was " in loads[0] and "(cold load was " in loads[1]
    for tag in PLOTS:
        assert any("image/png" in o.get("data", {}) for o in second[tag].outputs), tag
    assert sorted(e["hits"] for e in daemon.entries()) == [1, 1]
