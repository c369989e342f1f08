"""The dependency manifest (Note [What a load depends on]): what the cold load read and ran is
recorded, and every hit checks it.

In-process: the audit hook's recorder (files read, not written; folders listed by the load, not
by the import system), the manifest of a load (a helper imported only by the model's module, an
installed module's file, a distribution's RECORD) and its check. In real processes against a real
daemon, the edit loop of each input the key does not name: a helper module of a model split over
three files, a config folder passed by path, a hub cache folder whose ``refs/main`` moves, a global
and a class attribute of ``python -c``'s ``__main__``, a package reinstalled with the same version;
and unchanged inputs stay warm, a transformers model class in ``__main__`` included.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from overmind_lab import Client
from overmind_lab._errors import NotCacheable
from overmind_lab._loading import manifest, user_code
from tests.conftest import TINY_LLAMA, pip_install_project, save_tiny_llama

pytestmark = pytest.mark.slow  # real processes: `make test`, not `make test-fast`

TIMEOUT = 300


# -- in-process ----------------------------------------------------------------------------
def test_the_recorder_sees_what_a_load_reads_not_what_it_writes(tmp_path: Path) -> None:
    read, written, listed = tmp_path / "read.json", tmp_path / "out.txt", tmp_path / "folder"
    read.write_text("{}")
    listed.mkdir()
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"x")
    with manifest.Recorder() as recorder:
        read.read_text()
        written.write_text("out")
        os.close(os.open(raw, os.O_RDONLY))
        os.close(os.open(tmp_path / "created", os.O_WRONLY | os.O_CREAT))
        os.listdir(listed)
        importlib.invalidate_caches()
        importlib.util.find_spec("no_such_module_anywhere")  # the import system lists folders
    read.read_text()  # after the load: not recorded
    assert list(recorder.files) == [str(read), str(raw)]
    assert list(recorder.dirs) == [str(listed)]
    os.chdir(tmp_path)
    try:
        with manifest.Recorder() as recorder:
            Path("read.json").read_text()  # relative: against the working directory
    finally:
        os.chdir("/")
    assert list(recorder.files) == [str(read)]


def test_a_file_changed_just_before_its_signature_is_compared_by_content(
        tmp_path: Path) -> None:
    """Note [Racy signatures]: an equal signature is trusted only for a file that had not changed
    within ``RACY_NS`` of being signed; the other is compared by content on every hit."""
    config = tmp_path / "config.json"
    config.write_text('{"a": 1}')
    [path, ident, digest] = manifest._record(str(config))  # type: ignore[misc]
    assert digest.startswith("!")  # just written
    assert manifest._differs(path, ident, digest) is None
    # The same signature with other content (what a write within one tick leaves): seen.
    assert manifest._differs(path, ident, "!" + "0" * 32) == f"{config} changed"
    # Signed long after its last change (no mark): the signature alone decides, one stat.
    assert manifest._differs(path, ident, "0" * 32) is None


def _module(tmp_path: Path, name: str, source: str) -> Any:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_a_helper_that_only_lends_a_constant_is_in_the_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    _module(tmp_path, "mf_consts", "WIDTH = 4\n")
    _module(tmp_path, "mf_layers", "import json\n\ndef factory():\n    return json.dumps([])\n")
    model = _module(tmp_path, "mf_model", """
        from mf_consts import WIDTH
        from mf_layers import factory as make

        class Model:
            width = WIDTH
    """)
    config = tmp_path / "conf" / "config.json"
    config.parent.mkdir()
    config.write_text('{"a": 1}')
    source = tmp_path / "weights"
    source.mkdir()
    (source / "w.bin").write_bytes(b"w")
    with manifest.Recorder() as recorder:
        config.read_text()
        (source / "w.bin").read_bytes()  # the key signs the source: not listed again
    found = manifest.build(recorder, [model.Model], None, str(source))
    assert [m[0] for m in found["modules"]] == ["mf_consts", "mf_layers", "mf_model"]
    assert [f[0] for f in found["files"]] == [str(config)]
    assert manifest.changed(found) is None
    assert manifest.changed(json.loads(json.dumps(found))) is None  # as the entry keeps it

    config.write_text('{"a": 2}')
    assert manifest.changed(found) == f"{config} changed"
    config.write_text('{"a": 1}')
    assert manifest.changed(found) is None  # the same content again: by its digest
    (tmp_path / "mf_consts.py").write_text("WIDTH = 5\n")
    assert "the module mf_consts" in (manifest.changed(found) or "")
    # This process imported WIDTH = 4: storing the load now would key the old object by the new
    # file (Note [A file changed under a running process]).
    with pytest.raises(NotCacheable, match="changed after this process imported it"):
        manifest.build(recorder, [model.Model], None, str(source))
    config.unlink()
    assert manifest.changed({"files": found["files"]}) == f"{config} was removed"
    for name in ("mf_consts", "mf_layers", "mf_model"):
        sys.modules.pop(name, None)


def test_an_installed_module_edited_in_place_and_a_reinstall_are_seen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site_dir = tmp_path / "lib" / "site-packages"
    (site_dir / "mfpkg").mkdir(parents=True)
    code = site_dir / "mfpkg" / "__init__.py"
    code.write_text("class Model:\n    scale = 1\n")
    info = site_dir / "mfpkg-1.0.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("mfpkg/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(site_dir))
    user_code.forget_roots()
    manifest._distribution_index.cache_clear()
    try:
        package = importlib.import_module("mfpkg")
        assert user_code.is_regular_file(str(code))
        found = manifest.build(manifest.Recorder(), [package.Model], None, None)
        assert found["code"][0][:2] == ["mfpkg", str(code)]
        assert found["dists"][0][:2] == ["mfpkg", str(info / "RECORD")]
        assert manifest.changed(found) is None
        (info / "RECORD").write_text("mfpkg/__init__.py,sha256=x,1\n")
        assert "the installed distribution of mfpkg" in (manifest.changed(found) or "")
        (info / "RECORD").write_text("mfpkg/__init__.py,,\n")
        code.write_text("class Model:\n    scale = 2\n")  # same version, same RECORD
        assert "the installed module mfpkg" in (manifest.changed(found) or "")
    finally:
        sys.modules.pop("mfpkg", None)
        monkeypatch.undo()
        user_code.forget_roots()
        manifest._distribution_index.cache_clear()


def test_globals_that_code_without_a_file_reads_enter_its_digest() -> None:
    scope: dict[str, Any] = {"__name__": "mf_cell"}
    module = type(sys)("mf_cell")
    sys.modules["mf_cell"] = module
    try:
        source = textwrap.dedent("""
            import torch
            WIDTH = 4
            class Net(torch.nn.Module):
                ACT = torch.nn.GELU
                def __init__(self):
                    super().__init__()
                    self.width = WIDTH
        """)
        exec(compile(source, "<mf_cell>", "exec"), scope)  # noqa: S102 - a cell
        module.__dict__.update(scope)
        first = user_code.object_digest(scope["Net"])
        scope["WIDTH"] = 5
        assert user_code.object_digest(scope["Net"]) != first
        scope["WIDTH"] = 4
        assert user_code.object_digest(scope["Net"]) == first
        scope["Net"].ACT = scope["torch"].nn.SiLU
        assert user_code.object_digest(scope["Net"]) != first
        scope["Net"].ACT = scope["torch"].nn.GELU
        scope["Net"].__slotnames__ = []  # what copyreg adds at the first pickle
        assert user_code.object_digest(scope["Net"]) == first
    finally:
        del sys.modules["mf_cell"]


def test_a_constant_edited_after_the_import_is_not_the_running_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = _module(tmp_path, "mf_const_only", "SCALE = 1.0\nNAMES = ('a', 'b')\n")
    path = str(tmp_path / "mf_const_only.py")
    try:
        assert user_code._current_in_memory(module, path)
        (tmp_path / "mf_const_only.py").write_text("SCALE = 2.0\nNAMES = ('a', 'b')\n")
        assert not user_code._current_in_memory(module, path)
    finally:
        sys.modules.pop("mf_const_only", None)


# -- real processes, a real daemon ----------------------------------------------------------
def run_script(path: Path, *, cwd: Path, args: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> Any:
    """Run a Python file (or ``-c`` code, ``args``) in a fresh interpreter; its last line, JSON."""
    command = [sys.executable, *args] if args else [sys.executable, str(path)]
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


SPLIT_MODEL = {
    "mf_helpers.py": "WIDTH = {width}\n",
    "mf_layers.py": """
import torch
from mf_helpers import WIDTH


def make_layer(n):
    layer = torch.nn.Linear(n, WIDTH, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.fill_({fill})
        layer.bias.zero_()
    return layer
""",
    "mf_net.py": """
import torch
from mf_layers import make_layer


class Net(torch.nn.Module):
    def __init__(self, path):
        super().__init__()
        self.layer = make_layer(3)
""",
}

SPLIT_LOAD = """
import json, overmind_lab
from mf_net import Net
with overmind_lab.record_loads() as events:
    net = overmind_lab.load(Net, "unused")
print(json.dumps([events[-1].outcome, net.layer.out_features,
                  float(net.layer.weight.sum()), events[-1].reason]))
"""


def _write_split(folder: Path, width: int, fill: float) -> None:
    for name, text in SPLIT_MODEL.items():
        (folder / name).write_text(text.format(width=width, fill=fill))


def test_a_model_split_over_three_files_edit_loop(daemon: Client, tmp_path: Path) -> None:
    """The loader is the class in ``mf_net``; ``mf_layers`` and ``mf_helpers`` enter only as what
    it imports: editing either is a miss, leaving them is warm."""
    _write_split(tmp_path, 4, 1.0)
    (tmp_path / "load.py").write_text(SPLIT_LOAD)
    load = tmp_path / "load.py"
    assert run_script(load, cwd=tmp_path)[:3] == ["cold", 4, 12.0]
    assert run_script(load, cwd=tmp_path)[:3] == ["warm", 4, 12.0]
    _write_split(tmp_path, 5, 1.0)  # the helper's constant
    edited = run_script(load, cwd=tmp_path)
    assert edited[:3] == ["cold", 5, 15.0] and "mf_helpers" in edited[3]
    assert run_script(load, cwd=tmp_path)[:3] == ["warm", 5, 15.0]
    _write_split(tmp_path, 5, 2.0)  # the layer factory
    edited = run_script(load, cwd=tmp_path)
    assert edited[:3] == ["cold", 5, 30.0] and "mf_layers" in edited[3]
    assert run_script(load, cwd=tmp_path)[:3] == ["warm", 5, 30.0]
    assert len(daemon.entries()) == 1  # replaced each time, one key



CONFIG_LOAD = """
import json, sys, overmind_lab
from transformers import LlamaForCausalLM
with overmind_lab.record_loads() as events:
    model = overmind_lab.load(LlamaForCausalLM.from_pretrained, sys.argv[1], config=sys.argv[2])
print(json.dumps([events[-1].outcome, model.config.rms_norm_eps, events[-1].reason]))
"""


def test_a_config_folder_passed_by_path_edit_loop(daemon: Client, tmp_path: Path) -> None:
    from transformers import LlamaConfig

    save_tiny_llama(tmp_path / "weights")
    LlamaConfig(**TINY_LLAMA, rms_norm_eps=1e-5).save_pretrained(tmp_path / "conf")
    (tmp_path / "load.py").write_text(CONFIG_LOAD)
    argv = (str(tmp_path / "load.py"), str(tmp_path / "weights"), str(tmp_path / "conf"))
    assert run_script(tmp_path, cwd=tmp_path, args=argv)[:2] == ["cold", 1e-5]
    assert run_script(tmp_path, cwd=tmp_path, args=argv)[:2] == ["warm", 1e-5]
    LlamaConfig(**TINY_LLAMA, rms_norm_eps=1e-3).save_pretrained(tmp_path / "conf")
    edited = run_script(tmp_path, cwd=tmp_path, args=argv)
    assert edited[:2] == ["cold", 1e-3] and "config.json changed" in edited[2]
    assert run_script(tmp_path, cwd=tmp_path, args=argv)[:2] == ["warm", 1e-3]


HUB_LOAD = """
import json, sys, overmind_lab
from transformers import LlamaForCausalLM
with overmind_lab.record_loads() as events:
    model = overmind_lab.load(LlamaForCausalLM.from_pretrained, "mf-org/tiny",
                              cache_dir=sys.argv[1])
print(json.dumps([events[-1].outcome, model.config.rms_norm_eps, events[-1].reason]))
"""


def test_a_hub_cache_folder_whose_main_moves(daemon: Client, tmp_path: Path) -> None:
    """``cache_dir=`` is text to the key; the hub's ``refs/main`` the load read is in the
    manifest."""

    repo = tmp_path / "hub" / "models--mf-org--tiny"
    for commit, eps in (("a" * 40, 1e-5), ("b" * 40, 1e-3)):
        save_tiny_llama(repo / "snapshots" / commit, rms_norm_eps=eps)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (tmp_path / "load.py").write_text(HUB_LOAD)
    argv = (str(tmp_path / "load.py"), str(tmp_path / "hub"))
    env = {"HF_HUB_OFFLINE": "1"}
    assert run_script(tmp_path, cwd=tmp_path, args=argv, env=env)[:2] == ["cold", 1e-5]
    assert run_script(tmp_path, cwd=tmp_path, args=argv, env=env)[:2] == ["warm", 1e-5]
    (repo / "refs" / "main").write_text("b" * 40)
    moved = run_script(tmp_path, cwd=tmp_path, args=argv, env=env)
    assert moved[:2] == ["cold", 1e-3] and "refs/main changed" in moved[2]
    assert run_script(tmp_path, cwd=tmp_path, args=argv, env=env)[:2] == ["warm", 1e-3]


MAIN_GLOBALS = """
import json, torch, overmind_lab
from transformers import LlamaConfig, LlamaForCausalLM
WIDTH = {width}


class Net(torch.nn.Module):
    ACT = torch.nn.{act}

    def __init__(self, path):
        super().__init__()
        self.width = WIDTH
        self.act = self.ACT()


class MyLlama(LlamaForCausalLM):
    pass


with overmind_lab.record_loads() as events:
    net = overmind_lab.load(Net, "unused")
    overmind_lab.load(MyLlama.from_pretrained, {llama!r})
print(json.dumps([e.outcome for e in events] + [net.width, type(net.act).__name__]))
"""


def test_globals_and_class_attributes_of_main_edit_loop(daemon: Client, tmp_path: Path) -> None:
    """``python -c``: a global a method reads, a class attribute that holds a class; and a
    transformers model class defined there stays warm while unchanged."""

    save_tiny_llama(tmp_path / "llama")

    def run(width: int, act: str) -> Any:
        code = MAIN_GLOBALS.format(width=width, act=act, llama=str(tmp_path / "llama"))
        return run_script(tmp_path, cwd=tmp_path, args=("-c", code))

    assert run(4, "GELU") == ["cold", "cold", 4, "GELU"]
    assert run(4, "GELU") == ["warm", "warm", 4, "GELU"]
    assert run(5, "GELU") == ["cold", "warm", 5, "GELU"]
    assert run(5, "GELU") == ["warm", "warm", 5, "GELU"]
    assert run(5, "SiLU") == ["cold", "warm", 5, "SiLU"]
    assert run(5, "SiLU") == ["warm", "warm", 5, "SiLU"]


PKG_SOURCE = """
import torch


class Net(torch.nn.Module):
    def __init__(self, path):
        super().__init__()
        self.version = {version!r}
"""

PKG_LOAD = """
import json, site, sys
site.addsitedir(sys.argv[1])
import overmind_lab
from mfinst import Net
with overmind_lab.record_loads() as events:
    net = overmind_lab.load(Net, "unused")
print(json.dumps([events[-1].outcome, net.version, events[-1].reason]))
"""


def test_a_package_reinstalled_with_the_same_version(daemon: Client, tmp_path: Path) -> None:
    project = tmp_path / "proj"
    (project / "mfinst").mkdir(parents=True)
    source = project / "mfinst" / "__init__.py"
    source.write_text(PKG_SOURCE.format(version="one"))
    site_dir = pip_install_project(project, "mfinst", tmp_path / "prefix", editable=False)
    (tmp_path / "load.py").write_text(PKG_LOAD)
    argv = (str(tmp_path / "load.py"), str(site_dir))
    assert run_script(tmp_path, cwd=tmp_path, args=argv)[:2] == ["cold", "one"]
    assert run_script(tmp_path, cwd=tmp_path, args=argv)[:2] == ["warm", "one"]
    source.write_text(PKG_SOURCE.format(version="two"))
    shutil.rmtree(project / "build", ignore_errors=True)
    # `pip install .` again: version 0.1 still
    pip_install_project(project, "mfinst", tmp_path / "prefix", editable=False)
    again = run_script(tmp_path, cwd=tmp_path, args=argv)
    assert again[:2] == ["cold", "two"], again
    assert run_script(tmp_path, cwd=tmp_path, args=argv)[:2] == ["warm", "two"]


CUSTOM_PIPELINE = """
from diffusers import StableDiffusionPipeline


class MfPipe(StableDiffusionPipeline):
    MARK = {mark}
"""

CUSTOM_LOAD = """
import json, sys, overmind_lab
from diffusers import DiffusionPipeline
with overmind_lab.record_loads() as events:
    pipe = overmind_lab.load(DiffusionPipeline.from_pretrained, sys.argv[1],
                             custom_pipeline=sys.argv[2], trust_remote_code=True)
print(json.dumps([events[-1].outcome, type(pipe).__name__, type(pipe).MARK,
                  events[-1].reason]))
"""


def test_a_local_custom_pipeline_edit_loop(daemon: Client, tmp_path: Path) -> None:
    """diffusers copies ``custom_pipeline``'s ``pipeline.py`` into its modules cache: the copy
    the load read is the dependency, not the module it imported."""
    import torch

    from benchmarks import models

    pipeline = models.build_sd15_pipeline(tmp_path / "sd15", dtype=torch.float32, tiny=True)
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "pipeline.py").write_text(CUSTOM_PIPELINE.format(mark=1))
    (tmp_path / "load.py").write_text(CUSTOM_LOAD)
    argv = (str(tmp_path / "load.py"), str(pipeline), str(custom))
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    assert run_script(tmp_path, cwd=tmp_path, args=argv, env=env)[:3] == ["cold", "MfPipe", 1]
    assert run_script(tmp_path, cwd=tmp_path, args=argv, env=env)[:3] == ["warm", "MfPipe", 1]
    (custom / "pipeline.py").write_text(CUSTOM_PIPELINE.format(mark=2))
    edited = run_script(tmp_path, cwd=tmp_path, args=argv, env=env)
    assert edited[:3] == ["cold", "MfPipe", 2] and "pipeline.py changed" in edited[3]
    assert run_script(tmp_path, cwd=tmp_path, args=argv, env=env)[:3] == ["warm", "MfPipe", 2]


TEXT_LOAD = """
import json, sys, overmind_lab
from transformers import LlamaForCausalLM
out = []
for text in sys.argv[1:]:
    with overmind_lab.record_loads() as events:
        model = overmind_lab.load(LlamaForCausalLM.from_pretrained, text)
    out.append([events[-1].outcome, model.config._name_or_path, model.name_or_path])
print(json.dumps(out))
"""


def test_the_result_records_the_callers_own_text(daemon: Client, tmp_path: Path) -> None:
    """Note [The caller's own text]: a relative path, a symlink and a trailing slash each give
    the result a plain load gives for that text."""

    save_tiny_llama(tmp_path / "llama")
    (tmp_path / "link").symlink_to(tmp_path / "llama")
    (tmp_path / "load.py").write_text(TEXT_LOAD)
    texts = ["llama", str(tmp_path / "link"), "llama/", str(tmp_path / "llama")]
    argv = (str(tmp_path / "load.py"), *texts)
    first = run_script(tmp_path, cwd=tmp_path, args=argv)
    assert first == [["cold", t, t] for t in texts]
    assert run_script(tmp_path, cwd=tmp_path, args=argv) == [["warm", t, t] for t in texts]


RUNTIME_LOAD = """
import json, sys, overmind_lab
sys.path.insert(0, sys.argv[1])
import mf_helpers
from mf_net import Net
if len(sys.argv) > 2:
    mf_helpers.WIDTH = int(sys.argv[2])  # a cell sets the helper's global
with overmind_lab.record_loads() as events:
    net = overmind_lab.load(Net, "unused")
print(json.dumps([events[-1].outcome, net.layer.out_features, events[-1].reason]))
"""


def test_a_helpers_global_set_at_run_time(daemon: Client, tmp_path: Path) -> None:
    """Note [Globals set at run time]: the file says 4, a cell sets 6 before the load."""
    _write_split(tmp_path, 4, 1.0)
    for name in ("mf_helpers", "mf_layers", "mf_net"):
        (tmp_path / f"{name}.py").write_text(
            (tmp_path / f"{name}.py").read_text().replace("from mf_helpers import WIDTH",
                                                          "import mf_helpers")
            .replace("(n, WIDTH,", "(n, mf_helpers.WIDTH,"))
    (tmp_path / "load.py").write_text(RUNTIME_LOAD)
    script = str(tmp_path / "load.py")

    def run(*width: str) -> Any:
        return run_script(tmp_path, cwd=tmp_path, args=(script, str(tmp_path), *width))[:2]

    assert run() == ["cold", 4]
    assert run() == ["warm", 4]
    assert run("6") == ["cold", 6]  # set at run time: the stored 4 is not this process's
    assert run("6") == ["warm", 6]
    assert run() == ["cold", 4]  # the entry was built from a value the file does not give
    assert run() == ["warm", 4]


def test_a_global_set_at_run_time_is_marked(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Globals set at run time], in this process: the entry of a module whose global was set
    after its import misses where the module is imported fresh (its file gives another value)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    helpers = _module(tmp_path, "mf_rt_helpers", "WIDTH = 4\nNAME = 'a'\n")
    model = _module(tmp_path, "mf_rt_model", "import mf_rt_helpers\n\nclass Model:\n    pass\n")
    try:
        found = manifest.build(manifest.Recorder(), [model.Model], None, None)
        states = {m[0]: m[4] for m in found["modules"]}
        assert not states["mf_rt_helpers"].startswith("~")
        assert manifest.changed(found) is None
        helpers.WIDTH = 6
        assert manifest.changed(found) == "the globals of the module mf_rt_helpers changed"
        found = manifest.build(manifest.Recorder(), [model.Model], None, None)
        assert {m[0]: m[4] for m in found["modules"]}["mf_rt_helpers"].startswith("~")
        assert manifest.changed(found) is None
        del sys.modules["mf_rt_helpers"]  # a fresh process: its file says 4
        assert manifest.changed(found) == "the module mf_rt_helpers had globals set at run time"
    finally:
        for name in ("mf_rt_helpers", "mf_rt_model"):
            sys.modules.pop(name, None)


def test_a_symlink_retargeted_is_another_file(tmp_path: Path) -> None:
    """A config reached through a link (``current -> v1``): pointing the link at ``v2`` is a
    change, though neither file changed."""
    for version in ("v1", "v2"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "config.json").write_text(f'{{"v": "{version}"}}')
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "v1")
    with manifest.Recorder() as recorder:
        (link / "config.json").read_text()
    found = manifest.build(recorder, [], None, None)
    assert [f[0] for f in found["files"]] == [str(link / "config.json")]
    assert manifest.changed(found) is None
    link.unlink()
    link.symlink_to(tmp_path / "v2")
    assert manifest.changed(found) == f"{link / 'config.json'} changed"
