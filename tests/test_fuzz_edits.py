"""The edit loop, generated (issue 33, item 7): a user model split over several modules, a config
file passed by path, a cell's global read by the loader; hypothesis draws the project and a
sequence of edits, and after each edit and a "restart" the cached load must equal a plain load of
the code and files as they are now: cold after an edit, warm after none.

A restart is simulated in this process: every module of the project is dropped from
``sys.modules`` and imported again (bytecode is not written, files are replaced, not rewritten in
place: Note [Racy signatures] covers a real restart's fresh process, not this process's caches),
the cell is executed again into a new module without a file. The daemon is real.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import overmind_lab
from overmind_lab import Client

pytestmark = pytest.mark.slow  # a real daemon, many loads: `make test`, not `make test-fast`

_projects = itertools.count()

#: What an edit changes: a helper's constant, the factory's code, the config file passed by path,
#: the cell's global read by the loader; "none" is a restart without an edit.
EDITS = ("const", "factory", "config", "cell", "none")


@st.composite
def plans(draw: st.DrawFn) -> dict[str, Any]:
    depth = draw(st.integers(1, 3))
    return {
        "depth": depth,
        "consts": draw(st.lists(st.integers(1, 9), min_size=depth, max_size=depth)),
        "factor": draw(st.integers(1, 5)),
        "scale": draw(st.integers(1, 5)),
        "gain": draw(st.integers(1, 5)),
        "edits": draw(st.lists(st.tuples(st.sampled_from(EDITS), st.integers(0, 2)),
                               min_size=1, max_size=5)),
    }


def _replace(path: Path, text: str) -> None:
    """Write ``path`` anew (a new inode, as most editors save)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(textwrap.dedent(text))
    os.replace(tmp, path)


class Project:
    """The files of one drawn project under a unique module prefix."""

    def __init__(self, root: Path, plan: dict[str, Any]) -> None:
        self.prefix = f"fe{next(_projects)}"
        self.root = root
        self.plan = {**plan, "consts": list(plan["consts"])}
        self.weights = root / f"{self.prefix}_weights"
        self.weights.mkdir()
        torch.save(torch.arange(4, dtype=torch.float32), self.weights / "w.pt")
        self.config = root / f"{self.prefix}_config.json"
        self.cell: types.ModuleType | None = None
        self.write_all()

    def write_all(self) -> None:
        p, plan = self.prefix, self.plan
        depth = plan["depth"]
        for i in range(depth):
            below = (f"from {p}_h{i + 1} import VALUE as _BELOW\n" if i + 1 < depth
                     else "_BELOW = 0\n")
            _replace(self.root / f"{p}_h{i}.py",
                     f"{below}VALUE = _BELOW * 10 + {plan['consts'][i]}\n")
        _replace(self.root / f"{p}_layers.py", f"""
            import torch
            from {p}_h0 import VALUE


            def make_layer():
                layer = torch.nn.Linear(2, 2, device="meta").to_empty(device="cpu")
                with torch.no_grad():
                    layer.weight.fill_(VALUE * {plan['factor']})
                    layer.bias.zero_()
                return layer
        """)
        _replace(self.root / f"{p}_net.py", f"""
            import json
            import torch
            from {p}_layers import make_layer


            class Net(torch.nn.Module):
                def __init__(self, path, config):
                    super().__init__()
                    self.layer = make_layer()
                    self.base = torch.nn.Parameter(torch.load(path + "/w.pt"))
                    with open(config) as f:
                        self.scale = json.load(f)["scale"]
        """)
        _replace(self.config, json.dumps({"scale": plan["scale"]}))

    def restart(self) -> types.ModuleType:
        """Drop the project's modules, import them again; the cell runs again: its module."""
        for name in [n for n in sys.modules if n.startswith(f"{self.prefix}_")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        cell = types.ModuleType(f"{self.prefix}_cell")  # a notebook cell: no file
        sys.modules[cell.__name__] = cell
        source = textwrap.dedent(f"""
            from {self.prefix}_net import Net
            GAIN = {self.plan['gain']}


            def make(path, config):
                net = Net(path, config)
                net.gain = GAIN
                return net
        """)
        exec(compile(source, f"<{self.prefix} cell>", "exec"), cell.__dict__)  # noqa: S102
        self.cell = cell
        return cell

    def edit(self, kind: str, which: int) -> None:
        plan = self.plan
        if kind == "const":
            i = which % plan["depth"]
            plan["consts"][i] = plan["consts"][i] % 9 + 1  # another value, 1..9
        elif kind == "factory":
            plan["factor"] = plan["factor"] % 5 + 1
        elif kind == "config":
            plan["scale"] = plan["scale"] % 5 + 1
        elif kind == "cell":
            plan["gain"] = plan["gain"] % 5 + 1
        self.write_all()


def _seen(net: Any) -> list[Any]:
    return [float(net.layer.weight.detach().sum()), net.base.tolist(), net.scale, net.gain]


@pytest.fixture
def project_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # a stale .pyc within one second
    yield tmp_path
    for name in [n for n in sys.modules if re.match(r"fe\d+_", n)]:
        del sys.modules[name]


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(plan=plans())
def test_every_edit_is_a_miss_and_no_edit_is_warm(daemon: Client, project_root: Path,
                                                  plan: dict[str, Any]) -> None:
    project = Project(project_root, plan)
    steps = [("first", 0), *plan["edits"]]
    for kind, which in steps:
        if kind != "first":
            project.edit(kind, which)
        cell = project.restart()
        args = (str(project.weights), str(project.config))
        expected = _seen(cell.make(*args))
        with overmind_lab.record_loads() as events:
            got = overmind_lab.load(cell.make, *args)
        outcome = events[-1].outcome
        assert _seen(got) == expected, (kind, outcome, events[-1].reason)
        wanted = "warm" if kind == "none" else "cold"
        assert outcome == wanted, (kind, events[-1].reason)
