"""Keys that see code: the user's edited code is a miss, unchanged code stays warm.

In-process: which code is regular (standard library, site-packages) and which is the
user's (their modules, ``__main__``, cells without a file, editable installs), and the
digests. In real processes against a real daemon: the edit loop of a model class of the
user's own (as the loader's class, and registered with an Auto class), two ``__main__``
scripts with different classes of one name, and a package installed with ``pip install
-e`` (setuptools, offline) whose file is edited.
"""

from __future__ import annotations

import importlib
import json
import linecache
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from overmind_lab import Client
from overmind_lab._errors import NotCacheable
from overmind_lab._loading import user_code
from tests.conftest import pip_install_project

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

# -- in-process: the decision and the digests ---------------------------------------------


@pytest.fixture
def fresh_roots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Roots computed again for a sys.path the test sets, and again after it."""
    user_code._roots.cache_clear()
    user_code.is_regular_file.cache_clear()
    yield
    monkeypatch.undo()
    user_code._roots.cache_clear()
    user_code.is_regular_file.cache_clear()


def test_stdlib_and_site_packages_are_regular_and_cost_nothing() -> None:
    assert user_code.is_regular_file(json.__file__)
    assert user_code.is_regular_file(torch.__file__)
    assert user_code.object_digest(json.JSONDecoder) is None
    assert user_code.object_digest(torch.nn.Linear) is None
    assert user_code.object_digest(len) is None  # a builtin: no file at all
    assert user_code.code_of(torch.load) == {}
    assert user_code.graph_code([torch.nn.Linear, torch.Tensor, dict, json.loads]) == {}


def test_a_module_of_the_user_is_digested_by_its_file(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    mod = tmp_path / "uc_usermod.py"
    mod.write_text("class Model:\n    scale = 1.0\n\ndef make(path):\n    return Model()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("uc_usermod")
    try:
        assert not user_code.is_regular_file(str(mod))
        digest = user_code.file_digest(str(mod))
        assert user_code.code_of(module.make) == {"uc_usermod:make": digest}
        assert user_code.graph_code([module.Model]) == {"uc_usermod:Model": digest}
        assert user_code.changed({"uc_usermod:Model": digest}) is None
        assert "changed" in (user_code.changed({"uc_usermod:Model": "0" * 32}) or "")
        _module_without_file("uc_empty", "")
        assert "not defined" in (user_code.changed({"uc_empty:Gone": "x"}) or "")
        assert "cannot be imported" in (user_code.changed({"uc_no_such_module:A": "x"}) or "")
        # Note [A file changed under a running process]: this module was written after
        # this process started, then imported: its code is the file's, it is keyed. An edit
        # after the import is not, until the module is reloaded.
        mod.write_text("class Model:\n    scale = 2.0\n\ndef make(path):\n    return 2\n")
        with pytest.raises(NotCacheable, match="changed after this process imported it"):
            user_code.code_of(module.make)
        assert "changed after" in (user_code.changed({"uc_usermod:Model": digest}) or "")
        module = importlib.reload(module)
        assert user_code.code_of(module.make) == {
            "uc_usermod:make": user_code.file_digest(str(mod))} != {"uc_usermod:make": digest}
    finally:
        sys.modules.pop("uc_usermod", None)
        sys.modules.pop("uc_empty", None)


def test_a_module_file_gone_since_its_import_makes_the_load_uncached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Digests never fail a load]: NotCacheable (one warning), not FileNotFoundError."""
    mod = tmp_path / "uc_gone.py"
    mod.write_text("def make(path):\n    return path\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("uc_gone")
    try:
        recorded = user_code.code_of(module.make)
        mod.unlink()
        with pytest.raises(NotCacheable, match="cannot be digested"):
            user_code.code_of(module.make)
        assert "No such file" in (user_code.changed(recorded) or "")
    finally:
        sys.modules.pop("uc_gone", None)


def _module_without_file(name: str, source: str, filename: str = "<string>") -> Any:
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def test_code_without_a_file_by_its_source_or_its_bytecode() -> None:
    """``python -c`` (no source anywhere: bytecode) and a notebook cell (linecache)."""
    one = "class Net:\n    def __init__(self):\n        self.tag = 'A'\n"
    two = "class Net:\n    def __init__(self):\n        self.tag = 'B'\n"
    try:
        a = _module_without_file("uc_nofile", one).Net
        a_again = _module_without_file("uc_nofile", one).Net
        b = _module_without_file("uc_nofile", two).Net
        assert user_code.object_digest(a) == user_code.object_digest(a_again)
        assert user_code.object_digest(a) != user_code.object_digest(b)
        assert user_code.graph_code([b]) == {"uc_nofile:Net": user_code.object_digest(b)}
        # a cell: IPython keeps its source in linecache under the cell's name
        cell = "<ipython-input-7-0123abcd>"
        source = "def make(path):\n    return path  # the cell's own words\n"
        linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
        made = _module_without_file("uc_nofile", source, cell).make
        with_comment = user_code.object_digest(made)
        source2 = source.replace("own words", "other words")
        linecache.cache[cell] = (len(source2), None, source2.splitlines(True), cell)
        assert user_code.object_digest(made) != with_comment  # the source, not bytecode
    finally:
        sys.modules.pop("uc_nofile", None)
        linecache.cache.pop("<ipython-input-7-0123abcd>", None)


def test_editable_roots_are_user_code_even_inside_a_regular_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_roots: None) -> None:
    site_dir = tmp_path / "site-packages"
    inside = site_dir / "checkout"  # an editable project inside a site folder
    outside = tmp_path / "proj"  # the usual place: a source tree
    for folder in (inside / "pkg", outside / "src" / "other", tmp_path / "egg" / "eggpkg"):
        folder.mkdir(parents=True)
    dist = site_dir / "inpkg-0.1.dist-info"
    dist.mkdir()
    (dist / "direct_url.json").write_text(json.dumps(
        {"url": inside.as_uri(), "dir_info": {"editable": True}}))
    (site_dir / "__editable__.inpkg-0.1.pth").write_text(f"{inside}\n")
    regular = site_dir / "plain-1.0.dist-info"  # installed from an index: no editable
    regular.mkdir()
    (site_dir / "plain.pth").write_text("import os\n")
    (site_dir / "__editable___other_0_1_finder.py").write_text(
        f"import sys\nMAPPING: dict[str, str] = {{'other': {str(outside / 'src' / 'other')!r}}}\n"
        "NAMESPACES = {}\n")
    (site_dir / "eggpkg.egg-link").write_text(f"{tmp_path / 'egg'}\n.\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(site_dir)])
    roots = dict(user_code._roots())
    assert roots[str(site_dir) + os.sep] is True
    assert roots[str(inside) + os.sep] is False
    assert roots[str(outside / "src" / "other") + os.sep] is False
    assert roots[str(tmp_path / "egg") + os.sep] is False
    assert user_code.is_regular_file(str(site_dir / "plainmod.py"))
    assert not user_code.is_regular_file(str(inside / "pkg" / "__init__.py"))
    assert not user_code.is_regular_file(str(tmp_path / "notebook_dir" / "mine.py"))
    # the stdlib and torch stay regular with the new roots
    assert user_code.is_regular_file(json.__file__) and user_code.is_regular_file(
        torch.__file__)


# -- real processes, a real daemon --------------------------------------------------------
TIMEOUT = 300


def run_script(path: Path, *, cwd: Path, env: dict[str, str] | None = None) -> Any:
    """Run a Python file in a fresh interpreter (killed on timeout); its last line, JSON."""
    proc = subprocess.run([sys.executable, str(path)], cwd=cwd, capture_output=True,
                          text=True, timeout=TIMEOUT, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_code(code: str, *, cwd: Path) -> Any:
    """Run ``python -c code``: ``__main__`` without a file."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


USER_MODEL = """
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


class MyConfig(LlamaConfig):
    model_type = "uc-llama"


class MyLlama(LlamaForCausalLM):
    config_class = MyConfig

    def __init__(self, config):
        super().__init__(config)
        self.scale = {scale}


AutoConfig.register("uc-llama", MyConfig)
AutoModelForCausalLM.register(MyConfig, MyLlama)
"""

SAVE = """
import json
from transformers import LlamaForCausalLM
from mymodel import MyConfig, MyLlama
cfg = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
LlamaForCausalLM(MyConfig(**cfg)).save_pretrained("llama")
print(json.dumps("saved"))
"""

LOAD_USER_MODEL = """
import json, overmind_lab
from transformers import AutoModelForCausalLM
from mymodel import MyLlama
out = {}
for route, fn in (("class", MyLlama.from_pretrained),
                  ("auto", AutoModelForCausalLM.from_pretrained)):
    with overmind_lab.record_loads() as events:
        model = overmind_lab.load(fn, "llama")
    out[route] = [events[-1].outcome, type(model).__name__, model.scale, events[-1].reason]
print(json.dumps(out))
"""


def test_an_edited_model_class_is_a_miss_and_unchanged_code_stays_warm(
        daemon: Client, tmp_path: Path) -> None:
    """The class called (in the key) and the class an Auto class built (in the entry)."""
    model_file = tmp_path / "mymodel.py"
    model_file.write_text(USER_MODEL.format(scale=1.0))
    (tmp_path / "save.py").write_text(SAVE)
    (tmp_path / "load.py").write_text(LOAD_USER_MODEL)
    run_script(tmp_path / "save.py", cwd=tmp_path)
    first = run_script(tmp_path / "load.py", cwd=tmp_path)
    assert first["class"][:3] == ["cold", "MyLlama", 1.0]
    assert first["auto"][:3] == ["cold", "MyLlama", 1.0]
    again = run_script(tmp_path / "load.py", cwd=tmp_path)
    assert again["class"][:3] == again["auto"][:3] == ["warm", "MyLlama", 1.0]
    [auto_entry] = [e for e in daemon.entries() if "AutoModel" in e["name"]]

    model_file.write_text(USER_MODEL.format(scale=2.0))  # the edit; then a "restart"
    edited = run_script(tmp_path / "load.py", cwd=tmp_path)
    assert edited["class"][:3] == ["cold", "MyLlama", 2.0]  # another key
    assert edited["auto"][:3] == ["cold", "MyLlama", 2.0]  # the entry's code differs
    assert "the code of mymodel:My" in edited["auto"][3]
    again = run_script(tmp_path / "load.py", cwd=tmp_path)
    assert again["class"][:3] == again["auto"][:3] == ["warm", "MyLlama", 2.0]
    entries = daemon.entries()
    assert len(entries) == 3  # the old class key stays; the Auto entry was replaced
    [replaced] = [e for e in entries if "AutoModel" in e["name"]]
    assert replaced["key"] == auto_entry["key"] and replaced["hits"] == 1


NET_SCRIPT = """
import json, sys, torch, overmind_lab


class Net(torch.nn.Module):
    def __init__(self, path):
        super().__init__()
        self.tag = {tag!r}
        self.weight = torch.nn.Parameter(torch.load(path))


def make(path):
    return Net(path)


with overmind_lab.record_loads() as events:
    net = overmind_lab.load(make, {path!r})
print(json.dumps([events[-1].outcome, net.tag, float(net.weight.sum())]))
"""


def test_two_main_scripts_with_a_class_of_one_name_get_their_own_objects(
        daemon: Client, tmp_path: Path) -> None:
    weights = tmp_path / "w.pt"
    torch.save(torch.ones(4), weights)
    a = NET_SCRIPT.format(tag="A", path=str(weights))
    b = NET_SCRIPT.format(tag="B", path=str(weights))
    # As files: the scripts differ, so do the loaders' keys.
    (tmp_path / "a.py").write_text(a)
    (tmp_path / "b.py").write_text(b)
    assert run_script(tmp_path / "a.py", cwd=tmp_path)[:2] == ["cold", "A"]
    assert run_script(tmp_path / "b.py", cwd=tmp_path)[:2] == ["cold", "B"]
    assert run_script(tmp_path / "a.py", cwd=tmp_path)[:2] == ["warm", "A"]
    assert run_script(tmp_path / "b.py", cwd=tmp_path)[:2] == ["warm", "B"]
    # As ``python -c``: no file, ``make``'s bytecode is the same in both, but it reads the
    # global ``Net``, whose digest enters ``make``'s (Note [Globals a cell's code reads]): two
    # keys, each warm with its own class.
    assert run_code(a, cwd=tmp_path)[:2] == ["cold", "A"]
    assert run_code(a, cwd=tmp_path)[:2] == ["warm", "A"]
    assert run_code(b, cwd=tmp_path)[:2] == ["cold", "B"]
    assert run_code(b, cwd=tmp_path)[:2] == ["warm", "B"]
    assert run_code(a, cwd=tmp_path)[:2] == ["warm", "A"]


EDITABLE_PKG = """
import torch


class Net(torch.nn.Module):
    def __init__(self, path):
        super().__init__()
        self.version = {version!r}
        self.weight = torch.nn.Parameter(torch.load(path))
"""

EDITABLE_LOAD = """
import json, site, sys
site.addsitedir({site_dir!r})  # where pip put the editable install's .pth and dist-info
import torch, overmind_lab
from overmind_lab._loading import user_code
import edpkg


def make(path):  # the loader: a function in __main__
    return edpkg.Net(path)


with overmind_lab.record_loads() as events:
    net = overmind_lab.load(make, {path!r})
roots = [r for r, regular in user_code._roots() if not regular]
print(json.dumps([events[-1].outcome, net.version, edpkg.__file__, roots]))
"""


def test_an_editable_install_edited_is_a_miss(daemon: Client, tmp_path: Path) -> None:
    project = tmp_path / "proj"
    package = project / "src" / "edpkg"
    package.mkdir(parents=True)
    source = package / "__init__.py"
    source.write_text(EDITABLE_PKG.format(version="one"))
    site_dir = pip_install_project(project, "edpkg", tmp_path / "prefix", editable=True)
    assert [p.name for p in site_dir.glob("*.dist-info")] == ["edpkg-0.1.dist-info"]
    weights = tmp_path / "w.pt"
    torch.save(torch.ones(4), weights)
    script = EDITABLE_LOAD.format(site_dir=str(site_dir), path=str(weights))

    outcome, version, file, roots = run_code(script, cwd=tmp_path)
    assert (outcome, version) == ("cold", "one")
    assert file == str(source) and str(project) + os.sep in roots  # from direct_url.json
    assert run_code(script, cwd=tmp_path)[:2] == ["warm", "one"]
    source.write_text(EDITABLE_PKG.format(version="two"))  # dist-info still says 0.1
    assert run_code(script, cwd=tmp_path)[:2] == ["cold", "two"]
    assert run_code(script, cwd=tmp_path)[:2] == ["warm", "two"]
