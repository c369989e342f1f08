"""The fingerprint sees what a result shares with the world outside it (Note [Sharing with the
outside] in ``overmind_lab/_common/fingerprint.py``): the user's globals, memory shared with numpy
arrays, what closures hold and what their hook handles remove. Each is named as a difference
between an object and its rebuild by our own pickling (what a warm hit is); ordinary models still
fingerprint alike plain and warm."""

from __future__ import annotations

import functools
import json.decoder
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import overmind_lab
from overmind_lab import Client
from overmind_lab._common.fingerprint import compare, difference, differences, fingerprint
from overmind_lab._loading import pickling
from overmind_lab._loading.pickling import hook_counter, set_hook_counter
from overmind_lab._loading.segments import map_segment, write_segment
from tests import outside_state as state
from tests.conftest import save_tiny_llama


class Holder:
    """A plain object to hang things on."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


def rebuilt(obj: Any, hooks: tuple[int, int] | None = None) -> Any:
    """``obj`` pickled and rebuilt as a warm hit is: ``pickling.dump`` into a memfd segment,
    ``pickling.load_stream`` from its mapping (``hooks``: renumber as a hit does, Note [Hook ids])."""
    stream, plan, kind = pickling.dump(obj)
    at = plan.place(stream, len(stream))
    fd = os.memfd_create("olt-fingerprint", os.MFD_CLOEXEC)
    write_segment(fd, plan.size, plan.items)
    mapping, _ = map_segment("olt-fingerprint", plan.size, fd)
    view = mapping.view(at, len(stream))
    try:
        return pickling.load_stream(view, kind, [mapping], plan.buffers, hooks=hooks)
    finally:
        view.release()


def named(plain: Any) -> str | None:
    return difference(fingerprint(rebuilt(plain)), fingerprint(plain))


def layer() -> torch.nn.Linear:
    model = torch.nn.utils.skip_init(torch.nn.Linear, 2, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.0)
    return model


# -- the user's globals ----------------------------------------------------------------------
@pytest.mark.parametrize("value, name", [
    (state.REGISTRY, "REGISTRY"), (state.HISTORY, "HISTORY"), (state.SETTINGS, "SETTINGS"),
    (state.SHARED_LAYER, "SHARED_LAYER"), (state.ARRAY, "ARRAY"),
], ids=["dict", "list", "instance", "module", "ndarray"])
def test_a_global_of_the_users_code_is_named(value: Any, name: str) -> None:
    plain = {"model": layer(), "state": [value]}
    assert fingerprint(plain)["['state'][0] global"] == f"{state.__name__}.{name}"
    assert named(plain) == (f"['state'][0] global: only in the plain result "
                            f"({state.__name__}.{name})")


def test_immutable_and_library_globals_and_the_result_itself_are_not_named() -> None:
    plain = {"sizes": state.SIZES, "backslash": json.decoder.BACKSLASH, "empty": ()}
    assert not [k for k in fingerprint(plain) if k.endswith(" global")]
    assert named(plain) is None
    assert " global" not in fingerprint(state.REGISTRY)  # a script's `result = load(...)` is a global


# -- memory shared with numpy ------------------------------------------------------------------
def test_a_tensor_over_an_array_in_the_result_is_named() -> None:
    array = numpy.zeros((2, 3), dtype=numpy.float32)
    plain = Holder(raw=array, weights=torch.from_numpy(array[1]))
    found = fingerprint(plain)
    assert found["raw shares memory"] == "with the storage of weights"
    assert found["weights shares memory"] == "with the numpy array raw"
    assert named(plain) == "raw shares memory: only in the plain result (with the storage of weights)"


def test_an_array_over_a_tensor_is_named() -> None:
    t = torch.arange(6.0)
    plain = {"t": t, "view": t.numpy()[2:]}
    assert list(differences(fingerprint(rebuilt(plain)), fingerprint(plain))) == [
        "['t'] shares memory: only in the plain result (with the numpy array ['view'])",
        "['view'] shares memory: only in the plain result (with the storage of ['t'])"]


def test_a_tensor_over_a_global_array_is_named() -> None:
    plain = {"t": torch.from_numpy(state.ARRAY)}
    assert named(plain) == ("['t'] shares memory: only in the plain result (with the numpy "
                            f"array global {state.__name__}.ARRAY)")


def test_tensors_and_arrays_apart_share_nothing() -> None:
    array = numpy.arange(8.0)
    plain = {"copy": torch.from_numpy(array.copy()), "array": array, "t": torch.ones(3),
             "timesteps": torch.from_numpy(numpy.arange(10)[::-1].copy())}
    assert not [k for k in fingerprint(plain) if k.endswith(" shares memory")]
    assert named(plain) is None


# -- closures, partials, methods -----------------------------------------------------------------
def self_removing_hook() -> torch.nn.Module:
    """A layer with a one-shot forward hook that removes itself through its handle (a closure)."""
    model = layer()

    def once(module: torch.nn.Module, args: Any, output: Any) -> None:
        handle.remove()

    handle = model.register_forward_hook(once)
    return model


def test_a_handle_in_a_closure_names_what_it_removes() -> None:
    before = hook_counter()
    cold = self_removing_hook()
    taken = (before, hook_counter())
    set_hook_counter(taken[1] + 5)  # a hit in a process whose counter is elsewhere
    start = hook_counter()
    warm = rebuilt(cold, hooks=taken)
    set_hook_counter(start)  # the plain load takes the hit's ids (as verify mode does)
    plain = self_removing_hook()
    handle = f"_forward_hooks[{start}].<locals>.handle"
    assert fingerprint(plain)[f"{handle} removes"] == f"_forward_hooks[{start}]"
    assert list(differences(fingerprint(warm), fingerprint(plain))) == [
        f"{handle}.id: int {before} vs {start}",
        f"{handle} removes: nothing (id {before} not in _forward_hooks) vs _forward_hooks[{start}]"]


def test_a_handle_to_a_table_outside_the_result_is_named() -> None:
    outside = layer()
    handle = outside.register_forward_hook(functools.partial(print))
    plain = {"cleanup": lambda: handle.remove()}
    assert fingerprint(plain)["['cleanup'].<locals>.handle removes"] == (
        f"a table outside the result[{handle.id}]")
    assert (f"['cleanup'].<locals>.handle removes: nothing (id {handle.id} not in a table gone) "
            f"vs a table outside the result[{handle.id}]") in differences(
        fingerprint(rebuilt(plain)), fingerprint(plain))


def scale(factor: float, x: Any) -> Any:
    return x * factor


@pytest.mark.parametrize("make, path", [
    (lambda v: functools.partial(scale, v), "['f'].args[0]"),
    (lambda v: functools.partial(scale, factor=v), "['f'].keywords['factor']"),
    (lambda v: (lambda x: x * v), "['f'].<locals>.v"),
    (lambda v: (lambda x, k=v: x * k), "['f'].__defaults__[0]"),
], ids=["partial args", "partial keywords", "closure cell", "default"])
def test_what_a_function_carries_is_compared(make: Callable[[float], Any], path: str) -> None:
    assert compare({"f": make(0.5)}, {"f": make(0.25)}) == f"{path}: float 0.5 vs 0.25"
    assert named({"f": make(0.5)}) is None


def test_a_bound_method_is_its_function_and_its_object() -> None:
    model = layer()
    found = fingerprint({"model": model, "f": model.forward})
    assert found["['f']"] == "builtins.method torch.nn.modules.linear.Linear.forward"
    assert found["['f'].__self__"] == "alias of ['model']"
    assert compare({"model": model, "f": layer().forward}, {"model": model, "f": model.forward}) \
        == "['f'].__self__: torch.nn.modules.linear.Linear training True vs alias of ['model']"


# -- never raises --------------------------------------------------------------------------------
class _Unreadable:
    """A user class whose instances raise when looked at."""

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        raise RuntimeError("not to be looked at")


UNREADABLE = _Unreadable()


def test_odd_functions_and_globals_are_recorded_not_raised() -> None:
    def empty_cell() -> Any:
        return later  # noqa: F821 - bound after: the cell is empty when fingerprinted

    found = fingerprint({"f": empty_cell, "odd": UNREADABLE})
    assert found["['f'].<locals>.later"] == "<empty cell>"
    assert "['odd'] !" in found
    later = 1  # noqa: F841


# -- ordinary models: plain equals warm, nothing outside -------------------------------------------
def _tiny_unet(path: Path) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(path)


def _llama(path: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path)


def _clip_tokenizer(path: Path) -> Any:
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_unet_dir: Path) -> dict[str, Path]:
    from benchmarks.models import build_tokenizer

    root = tmp_path_factory.mktemp("outside")
    return {"unet": tiny_unet_dir, "llama": save_tiny_llama(root / "llama"),
            "tokenizer": build_tokenizer(root / "tokenizer")}


@pytest.mark.parametrize("name, loader", [
    ("unet", _tiny_unet), ("llama", _llama), ("tokenizer", _clip_tokenizer)])
def test_ordinary_models_fingerprint_alike_plain_and_warm(
        daemon: Client, model_dirs: dict[str, Path], name: str,
        loader: Callable[[Path], Any]) -> None:
    path = model_dirs[name]
    with overmind_lab.record_loads() as events:
        overmind_lab.load(loader, path)
        warm = overmind_lab.load(loader, path)
    assert [e.outcome for e in events] == ["cold", "warm"]
    plain = fingerprint(loader(path))
    assert difference(fingerprint(warm), plain) is None
    assert not [k for k in plain if k.endswith((" global", " shares memory", " removes"))]
    if name == "tokenizer":  # CLIP's wrapped decode: its closure is walked
        assert plain["_tokenizer.decode.<locals>.orig_decode_method.__self__"] == (
            "alias of _tokenizer")
