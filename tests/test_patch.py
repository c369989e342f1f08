"""Patching from_pretrained: exact undo, patch-on-import, keys by the class really called,
one cached load per call however the classes delegate, dynamic modules in a new process."""

from __future__ import annotations

import inspect
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from diffusers import UNet2DConditionModel

import overmind_lab
from benchmarks import models as _models
from overmind_lab import Client, OvermindWarning
from overmind_lab._loading.patch import _ROOTS, patched_names
from tests.conftest import last_json, run_py

REPO = str(Path(overmind_lab.__file__).resolve().parents[1])
CHILD_ENV = {"PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def patched() -> Iterator[None]:
    overmind_lab.patch_all()
    yield
    overmind_lab.unpatch_all()


@pytest.fixture(scope="module")
def text_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _models.build_text_encoder(tmp_path_factory.mktemp("te") / "text_encoder",
                                      dtype="float32", tiny=True)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _models.build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def _import_every_root() -> list[tuple[type, str]]:
    import importlib

    found: list[tuple[type, str]] = []
    for module, name, methods in _ROOTS:
        cls = getattr(importlib.import_module(module), name)
        found.extend((cls, m) for m in methods)
    return found


def test_patch_twice_then_unpatch_restores_the_exact_originals() -> None:
    targets = _import_every_root()
    from transformers import AutoModel, AutoModelForCausalLM

    targets += [(AutoModel, "from_pretrained"), (AutoModelForCausalLM, "from_pretrained")]
    before = {t: t[0].__dict__[t[1]] for t in targets}

    overmind_lab.patch_all()
    first = {t: t[0].__dict__[t[1]] for t in targets}
    overmind_lab.patch_all()
    try:
        for (cls, name), attr in before.items():
            assert cls.__dict__[name] is first[(cls, name)], "patching twice re-wrapped"
            assert cls.__dict__[name] is not attr
            assert overmind_lab.is_patched(cls, name)
            assert overmind_lab.get_original(cls, name).__func__ is attr.__func__
        assert overmind_lab.is_patched()
    finally:
        overmind_lab.unpatch_all()

    for (cls, name), attr in before.items():
        assert cls.__dict__[name] is attr
        assert not overmind_lab.is_patched(cls, name)
    assert not overmind_lab.is_patched()
    assert patched_names() == []
    assert not any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path)


def test_every_root_of_the_table_exists_in_the_installed_libraries(patched: None) -> None:
    """A root that moved in a new diffusers/transformers release would silently not be
    patched: fail here instead."""
    _import_every_root()
    names = set(patched_names())
    for module, cls, methods in _ROOTS:
        for method in methods:
            assert f"{module}.{cls}.{method}" in names


def test_the_wrapper_keeps_signature_and_docstring(patched: None) -> None:
    patched_method = UNet2DConditionModel.from_pretrained
    original = overmind_lab.get_original(patched_method)
    assert original.__self__ is UNet2DConditionModel
    assert overmind_lab.get_original(UNet2DConditionModel, "from_pretrained") == original
    assert inspect.signature(patched_method) == inspect.signature(original)
    assert patched_method.__doc__ == original.__doc__
    assert patched_method.__name__ == "from_pretrained"
    # not patched: returned as is
    assert overmind_lab.get_original(len) is len


PATCH_BEFORE_IMPORT = """
import inspect, json, sys
import overmind_lab
from overmind_lab._loading.patch import patched_names
overmind_lab.patch_all()
assert "diffusers" not in sys.modules and "transformers" not in sys.modules
from diffusers import UNet2DConditionModel, StableDiffusionPipeline, DDIMScheduler
from transformers import AutoModel, AutoTokenizer, CLIPTextModel
import diffusers.models.modeling_utils as mu
assert mu.__loader__ is mu.__spec__.loader and type(mu.__loader__).__name__ == "SourceFileLoader"
assert "class ModelMixin" in inspect.getsource(mu)
checks = [overmind_lab.is_patched(c.from_pretrained) for c in
          (UNet2DConditionModel, StableDiffusionPipeline, DDIMScheduler, AutoModel,
           AutoTokenizer, CLIPTextModel)]
names = patched_names()
automodel_attr = AutoModel.__dict__["from_pretrained"]
overmind_lab.unpatch_all()
restored = AutoModel.__dict__["from_pretrained"]
print(json.dumps({
    "checks": checks, "names": names,
    "restored_is_plain": not hasattr(restored.__func__, "__overmind_original__"),
    "restored_doc": restored.__func__.__doc__ == automodel_attr.__func__.__doc__,
    "hooks": [type(f).__name__ for f in sys.meta_path],
}))
"""

PATCH_AFTER_IMPORT = """
import json
import os
from diffusers import UNet2DConditionModel, StableDiffusionPipeline, DDIMScheduler
from transformers import AutoModel, AutoTokenizer, CLIPTextModel
import overmind_lab
from overmind_lab._loading.patch import patched_names
overmind_lab.patch_all()
print(json.dumps({"names": patched_names()}))
"""


@pytest.mark.slow
def test_patching_before_import_patches_modules_as_they_load() -> None:
    before = last_json(run_py(PATCH_BEFORE_IMPORT, env=CHILD_ENV))
    after = last_json(run_py(PATCH_AFTER_IMPORT, env=CHILD_ENV))
    assert before["checks"] == [True] * 6
    assert before["names"] == after["names"]
    assert "transformers.models.auto.modeling_auto.AutoModel.from_pretrained" in before["names"]
    # AutoModel copied the already patched base method at import (Note [Copied wrappers]):
    # unpatching still leaves the library's own, uncached method.
    assert before["restored_is_plain"] and before["restored_doc"]
    assert "_PatchOnImport" not in before["hooks"]


def test_clip_text_model_and_with_projection_are_different_entries(
        daemon: Client, patched: None, tmp_path: Path) -> None:
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    # A checkpoint with the projection: neither load draws random numbers (a load that
    # initialises a missing projection at random is not cached, so seeds keep working).
    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=1000, hidden_size=32, intermediate_size=37,
                            num_hidden_layers=2, num_attention_heads=4, projection_dim=16)
    text_encoder_dir = tmp_path / "text_encoder"
    with overmind_lab.bypass():
        CLIPTextModelWithProjection(config).save_pretrained(text_encoder_dir)

    with overmind_lab.record_loads() as cold:
        a = CLIPTextModel.from_pretrained(text_encoder_dir)
        b = CLIPTextModelWithProjection.from_pretrained(text_encoder_dir)
    with overmind_lab.record_loads() as warm:
        a2 = CLIPTextModel.from_pretrained(text_encoder_dir)
        b2 = CLIPTextModelWithProjection.from_pretrained(text_encoder_dir)

    assert [e.outcome for e in cold] == ["cold", "cold"]
    assert [e.outcome for e in warm] == ["warm", "warm"]
    assert cold[0].key != cold[1].key
    assert [e.key for e in warm] == [e.key for e in cold]
    assert type(a2) is type(a) is CLIPTextModel
    assert type(b2) is type(b) is CLIPTextModelWithProjection
    names = sorted(e["name"] for e in daemon.entries())
    assert names == [f"CLIPTextModel.from_pretrained({str(text_encoder_dir)!r})",
                     f"CLIPTextModelWithProjection.from_pretrained({str(text_encoder_dir)!r})"]


class MyUNet(UNet2DConditionModel):
    """A user subclass that overrides from_pretrained and delegates with super()."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().from_pretrained(*args, **kwargs)


def test_delegating_classes_are_cached_once(
        daemon: Client, patched: None, text_encoder_dir: Path) -> None:
    """AutoModel -> CLIPTextModel, and a user subclass overriding from_pretrained with
    super(): one entry each, keyed by the class the user called."""
    from transformers import AutoModel, CLIPTextModel

    unet_dir = _models.build_unet(text_encoder_dir.parent / "unet", dtype="float32", tiny=True)
    with overmind_lab.record_loads() as events:
        model = AutoModel.from_pretrained(text_encoder_dir)
        unet = MyUNet.from_pretrained(unet_dir)
    assert [(e.outcome, e.name.split("(")[0]) for e in events] == [
        ("cold", "AutoModel.from_pretrained"), ("cold", "MyUNet.from_pretrained")]
    assert type(model) is CLIPTextModel and type(unet) is MyUNet
    assert len(daemon.entries()) == 2

    with overmind_lab.record_loads() as events:
        AutoModel.from_pretrained(text_encoder_dir)
    assert [e.outcome for e in events] == ["warm"]


def test_an_argument_the_key_cannot_hold_loads_plainly_with_one_warning(
        daemon: Client, patched: None, tokenizer_dir: Path) -> None:
    from transformers import CLIPTokenizer

    class Marker:
        pass

    marker = Marker()
    with warnings.catch_warnings(record=True) as caught, \
            overmind_lab.record_loads() as events:
        warnings.simplefilter("always")
        first = CLIPTokenizer.from_pretrained(tokenizer_dir, marker=marker)
        CLIPTokenizer.from_pretrained(tokenizer_dir, marker=marker)
    assert [(w.category, "cannot be part of a cache key" in str(w.message))
            for w in caught] == [(OvermindWarning, True)]
    assert [e.outcome for e in events] == ["uncached", "uncached"]
    assert first("a photo")["input_ids"][0] == 49406
    assert daemon.entries() == []


def test_an_error_of_the_original_loader_reaches_the_user_unchanged(
        daemon: Client, patched: None, tmp_path: Path) -> None:
    original = overmind_lab.get_original(UNet2DConditionModel.from_pretrained)
    with pytest.raises(Exception) as plain:
        original(tmp_path / "missing")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(type(plain.value)) as cached:
            UNet2DConditionModel.from_pretrained(tmp_path / "missing")
    assert str(cached.value) == str(plain.value)


CUSTOM_PIPELINE = '''
from diffusers import DiffusionPipeline


class MyPipeline(DiffusionPipeline):
    def __init__(self, unet, scheduler):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler)
'''

LOAD_CUSTOM = """
import hashlib, json, sys
import overmind_lab
overmind_lab.patch_all()
from diffusers import DiffusionPipeline
with overmind_lab.record_loads() as events:
    pipe = DiffusionPipeline.from_pretrained({path!r}, trust_remote_code=True)
digest = hashlib.sha256()
for name, t in sorted(pipe.unet.state_dict().items()):
    digest.update(name.encode()); digest.update(t.numpy().tobytes())
print(json.dumps({{"outcomes": [e.outcome for e in events], "class": type(pipe).__module__
                  + "." + type(pipe).__qualname__, "weights": digest.hexdigest()}}))
"""


@pytest.mark.slow
def test_a_custom_pipeline_from_a_local_directory_loads_warm_in_a_new_process(
        daemon: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    root = tmp_path / "custom"
    _models.build_unet(root / "unet", dtype="float32", tiny=True)
    _models.build_scheduler(root / "scheduler")
    (root / "my_pipeline.py").write_text(CUSTOM_PIPELINE)
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": ["my_pipeline", "MyPipeline"], "_diffusers_version": "0.42.1",
        "unet": ["diffusers", "UNet2DConditionModel"],
        "scheduler": ["diffusers", "PNDMScheduler"],
    }))
    first = last_json(run_py(LOAD_CUSTOM.format(path=str(root)), env=CHILD_ENV))
    second = last_json(run_py(LOAD_CUSTOM.format(path=str(root)), env=CHILD_ENV))
    assert first["outcomes"] == ["cold"]
    assert second["outcomes"] == ["warm"]
    assert first["class"] == second["class"] == "diffusers_modules.local.my_pipeline.MyPipeline"
    assert first["weights"] == second["weights"]


AHEAD_CHILD = """
import json, os, overmind_lab
from overmind_lab import Client
from overmind_lab._loading.patch import wait_ahead
before = Client().status()["running"]
overmind_lab.patch_all()
wait_ahead(120)
print(json.dumps({"before": before, "after": Client().status()["running"],
                  "socket": os.path.exists(os.environ["OVERMIND_LAB_SOCKET"])}))
"""


def test_patch_all_starts_the_daemon_ahead(sock_path: Path) -> None:
    """Note [A daemon started ahead]: the first load of a login finds the daemon listening."""
    got = last_json(run_py(AHEAD_CHILD, env={"OVERMIND_LAB_START_AHEAD": "1"}))
    assert got == {"before": False, "after": True, "socket": True}


def test_a_dead_daemons_socket_is_left_to_the_load(sock_path: Path) -> None:
    """A stale socket: nothing is started ahead; the first load replaces the daemon and says
    that it had died (its entries in memory are gone)."""
    import socket as _socket

    stale = _socket.socket(_socket.AF_UNIX)
    stale.bind(str(sock_path))
    stale.close()
    proc = run_py(AHEAD_CHILD + """
import warnings
from tests.loaders import scaled_load
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    overmind_lab.load(scaled_load, 3)
print(json.dumps([str(w.message) for w in caught]))
""", env={"OVERMIND_LAB_START_AHEAD": "1", "PYTHONPATH": str(Path(__file__).parent.parent)})
    lines = proc.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == {"before": False, "after": False, "socket": True}
    assert any("had died" in w for w in json.loads(lines[-1])), lines[-1]


# A fork at a drawn moment after patch_all in a fresh login, while the thread that starts the
# daemon may be importing the client: the child's own load must finish (an alarm ends a hang)
# and be served (Note [A fork while the thread imports], 5, in ``prewarm``).
FORK_AFTER_AHEAD = """
import json, os, signal, sys, time
import overmind_lab
overmind_lab.patch_all()  # in a bare interpreter: the thread's imports take ~10 ms
time.sleep({delay})
pid = os.fork()
if pid == 0:
    signal.alarm(60)
    with overmind_lab.record_loads() as events:
        overmind_lab.load(json.loads, '[1, 2]')
    sys.stdout.write(json.dumps({{"child": events[-1].outcome}}) + "\\n")
    sys.stdout.flush()
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(json.dumps({{"status": status}}))
"""


def test_a_fork_while_the_daemon_starts_ahead_leaves_the_child_working(sock_path: Path) -> None:
    import random

    rng = random.Random(35)
    for seed in range(6):
        delay = 0 if seed < 2 else rng.uniform(0, 0.03)
        proc = run_py(FORK_AFTER_AHEAD.format(delay=delay), timeout=120,
                      env={"OVERMIND_LAB_START_AHEAD": "1"})
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        assert {"status": 0} in lines, proc
        assert any("child" in x for x in lines), proc
        Client(sock_path).stop()  # the next case's login starts one again


def test_a_forked_child_lets_go_of_the_start_lock(tmp_path: Path) -> None:
    """A fork while the thread holds the start lock: the child's copy is closed at once, so the
    lock is free when the parent lets go of it (else every start waits for the child)."""
    import fcntl

    from overmind_lab._loading import client

    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    client._start_locks.add(fd)
    try:
        checked_r, checked_w = os.pipe()  # the child: "my copy is closed" (or not)
        done_r, done_w = os.pipe()  # the parent: "done", the child may exit
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(done_w)
            try:
                os.fstat(fd)
                os.write(checked_w, b"n")  # still open
            except OSError:
                os.write(checked_w, b"y")
            os.read(done_r, 1)  # lives until the parent is done
            os._exit(0)
        os.close(checked_w)
        os.close(done_r)
        try:
            assert os.read(checked_r, 1) == b"y"
            client._start_locks.discard(fd)
            os.close(fd)
            other = os.open(tmp_path / "lock", os.O_RDWR)
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free although the child lives
            os.close(other)
        finally:
            os.close(done_w)
            os.close(checked_r)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        client._start_locks.discard(fd)
