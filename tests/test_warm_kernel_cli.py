"""``overmind-lab kernel install|status|uninstall`` as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


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
    assert spec["argv"] == [sys.executable, "-m", "ipykernel_launcher", "-f",
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
