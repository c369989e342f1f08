"""What a warm rebuild could not give back (``_loading/faithful.py``, Note [What pickling cannot
carry]): each case is found in a cold result and named by its path; real models of diffusers and
transformers are not flagged."""

from __future__ import annotations

import json.decoder
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import overmind_lab
from overmind_lab import Client, OvermindWarning
from overmind_lab._errors import NotCacheable
from overmind_lab._loading.faithful import check
from tests import outside_state as state


class Holder:
    """A plain object to hang things on."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


def reason(result: Any, by_reference: tuple[int, ...] = ()) -> str:
    with pytest.raises(NotCacheable) as caught:
        check(result, by_reference)
    return str(caught.value)


def leaf(requires_grad: bool = False) -> torch.Tensor:
    return torch.zeros(3, requires_grad=requires_grad)


def layer() -> torch.nn.Linear:
    return torch.nn.utils.skip_init(torch.nn.Linear, 2, 2)  # no random draw


def identity_hook(*args: Any) -> None:
    """A hook pickled by name."""


# -- 1. tensor hooks -------------------------------------------------------------------------
def test_a_tensor_backward_hook_is_named() -> None:
    model = torch.nn.Sequential(layer())
    model[0].weight.register_hook(lambda grad: grad)
    assert reason({"unet": model}) == (
        "`['unet'].0.weight` has a backward hook (Tensor.register_hook): a rebuilt tensor would "
        "not have it")


def test_a_post_accumulate_grad_hook_is_named() -> None:
    t = leaf(requires_grad=True)
    t.register_post_accumulate_grad_hook(lambda tensor: None)
    assert reason(Holder(scale=t)).startswith("`scale` has a post-accumulate-grad hook")


# -- 2. compiled code --------------------------------------------------------------------------
def test_a_compiled_submodule_is_named() -> None:
    model = torch.nn.Sequential(layer(), layer())
    model[1].compile(backend="eager")
    assert reason(model) == ("`1` was compiled (nn.Module.compile): a rebuild would drop its "
                             "compiled forward")


def test_a_torch_compile_wrapper_is_named() -> None:
    wrapped = torch.compile(layer(), backend="eager")
    assert reason({"model": wrapped}).startswith(
        "`['model']` is a torch.compile wrapper (OptimizedModule)")


def test_a_compiled_function_is_named() -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    assert reason(Holder(forward=torch.compile(forward, backend="eager"))).startswith(
        "`forward` is a function wrapped by torch.compile")


# -- 3. inference tensors ------------------------------------------------------------------------
def test_an_inference_tensor_is_named() -> None:
    model = layer()
    with torch.inference_mode():
        model.register_buffer("table", torch.ones(2))
    assert reason(model) == ("`table` is an inference tensor (made under torch.inference_mode): "
                             "a rebuilt one would be a normal tensor")


# -- 4. weak references --------------------------------------------------------------------------
def test_a_weak_reference_to_an_object_outside_is_named() -> None:
    outside = layer()
    assert reason({"owner": weakref.ref(outside)}).startswith(
        "`['owner']` is a weak reference to an object outside the result")


def test_a_weak_reference_inside_the_result_is_carried() -> None:
    inner = layer()
    check({"layer": inner, "ref": weakref.ref(inner), "method": weakref.WeakMethod(inner.forward),
           "proxy": weakref.proxy(inner)})


@pytest.mark.parametrize("make, path", [
    (lambda o: weakref.WeakValueDictionary({"k": o}), "`cache['k']`"),
    (lambda o: weakref.WeakKeyDictionary({o: 1}), "`cache.<key <Linear>>`"),
    (lambda o: weakref.WeakSet([o]), "`cache.<item Linear>`"),
    (lambda o: weakref.proxy(o), "`cache`"),
    (lambda o: weakref.WeakMethod(o.forward), "`cache`"),
], ids=["WeakValueDictionary", "WeakKeyDictionary", "WeakSet", "proxy", "WeakMethod"])
def test_weak_containers_and_proxies_to_objects_outside_are_named(
        make: Callable[[Any], Any], path: str) -> None:
    outside = layer()
    assert reason(Holder(cache=make(outside))).startswith(
        f"{path} is a weak reference to an object outside the result")


def test_a_live_finalizer_is_named() -> None:
    inner = layer()
    result = Holder(layer=inner, cleanup=weakref.finalize(inner, print, "bye"))
    assert reason(result).startswith("`cleanup` is a live weakref.finalize")
    result.cleanup.detach()
    check(result)  # dead: a rebuilt one is as dead


def test_a_handle_to_a_module_outside_is_named() -> None:
    outside = layer()
    handle = outside.register_forward_hook(identity_hook)
    assert reason({"handle": handle}).startswith(
        "`['handle'].hooks_dict_ref` is a weak reference to an object outside the result")


# -- 5. the user's globals -------------------------------------------------------------------
@pytest.mark.parametrize("value, name", [
    (state.REGISTRY, "REGISTRY (dict)"), (state.HISTORY, "HISTORY (list)"),
    (state.ARRAY, "ARRAY (ndarray)"), (state.SETTINGS, "SETTINGS (Settings)"),
    (state.SHARED_LAYER, "SHARED_LAYER (Linear)"),
], ids=["dict", "list", "ndarray", "instance", "module"])
def test_a_global_of_the_users_code_is_named(value: Any, name: str) -> None:
    text = reason({"model": layer(), "state": [value]})
    assert text == (f"`['state'][0]` is the global {state.__name__}.{name}: a rebuild would make a "
                    "copy, no longer that object")


def test_immutable_and_library_globals_are_not_flagged() -> None:
    check({"sizes": state.SIZES, "backslash": json.decoder.BACKSLASH, "empty": ()})


def test_objects_held_by_reference_are_neither_walked_nor_judged() -> None:
    component = state.SHARED_LAYER  # as if it came from the cache, passed to the call
    result = {"unet": component, "ref": weakref.ref(component)}
    assert "is the global" in reason(result)
    check(result, by_reference=(id(component),))


# -- 6. memory shared with numpy ------------------------------------------------------------
def test_a_tensor_over_an_array_in_the_result_is_named() -> None:
    array = numpy.zeros((2, 3), dtype=numpy.float32)
    result = Holder(raw=array, weights=torch.from_numpy(array[1]))
    assert reason(result) == (
        "`weights` shares memory with the numpy array at `raw` (torch.from_numpy, "
        "Tensor.numpy): a rebuild would give each its own copy")


def test_an_array_over_a_tensor_is_named() -> None:
    t = torch.arange(6.0)
    assert reason({"t": t, "view": t.numpy()[2:]}).startswith(
        "`['t']` shares memory with the numpy array at `['view']`")


def test_a_tensor_over_a_global_array_is_named() -> None:
    assert reason({"t": torch.from_numpy(state.ARRAY)}) == (
        f"`['t']` shares memory with the numpy array {state.__name__}.ARRAY (torch.from_numpy): "
        "a rebuilt tensor would have its own copy")


def test_a_tensor_over_an_array_held_nowhere_else_is_not_flagged() -> None:
    # Nothing to share with after the load (diffusers' schedulers do this); an array held
    # elsewhere, outside the user's globals, cannot be seen at all (Note [What pickling cannot
    # carry]).
    check({"timesteps": torch.from_numpy(numpy.arange(10)[::-1].copy()),
           "copy": numpy.arange(3.0), "t": torch.ones(3)})


# -- 7. hook handles where renumbering does not look ---------------------------------------
def self_removing_hook() -> torch.nn.Module:
    """A layer with a one-shot forward hook that removes itself through its handle."""
    model = layer()
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.0)

    def once(module: torch.nn.Module, args: Any, output: Any) -> None:
        handle.remove()

    handle = model.register_forward_hook(once)
    return model


def test_a_hook_handle_in_a_closure_is_named() -> None:
    assert reason(self_removing_hook()) == (
        "`_forward_hooks[once].<locals>.handle` is a hook handle (RemovableHandle) held in a "
        "closure or the like, where a rebuild does not renumber it: its remove() would no longer "
        "remove its hook")


def test_a_hook_handle_also_held_in_an_attribute_is_carried() -> None:
    model = layer()

    def once(module: torch.nn.Module, args: Any, output: Any) -> None:
        handle.remove()

    handle = model.register_forward_hook(once)
    model.handles = [handle]  # where renumbering finds it
    check(model)


# -- paths, as a property -------------------------------------------------------------------
Step = tuple[str, Any]
steps = st.lists(st.one_of(
    st.tuples(st.just("attr"), st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)),
    st.tuples(st.just("key"), st.text(alphabet="ab '\"", max_size=4)),
    st.tuples(st.just("index"), st.integers(0, 3)),
), max_size=6)


def nest(value: Any, path: list[Step]) -> Any:
    for kind, step in reversed(path):
        if kind == "attr":
            value = Holder(**{step: value})
        elif kind == "key":
            value = {step: value}
        else:
            value = [None] * step + [value]
    return value


def written(path: list[Step]) -> str:
    text = "".join(f".{s}" if kind == "attr" else f"[{s!r}]" for kind, s in path)
    return f"`{text.removeprefix('.')}`" if text else "the result itself"


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(steps)
def test_the_path_named_is_the_path_to_the_object(path: list[Step]) -> None:
    with torch.inference_mode():
        flagged = torch.ones(1)
    assert reason(nest(flagged, path)).startswith(f"{written(path)} is an inference tensor")
    check(nest(torch.ones(1), path))


# -- never fails -----------------------------------------------------------------------------
class Hostile:
    """An object that raises when looked at."""

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        raise RuntimeError("not to be looked at")


def test_an_object_that_raises_when_looked_at_makes_no_verdict() -> None:
    check({"odd": Hostile(), "t": torch.ones(1)})


# -- real models ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sd15_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks import models as _models

    return _models.build_sd15_pipeline(tmp_path_factory.mktemp("sd") / "sd15",
                                       dtype=torch.float32, tiny=True)


def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1))


REAL: dict[str, Callable[[Path, Path], Any]] = {
    "conftest-unet": lambda sd, unet: _diffusers("UNet2DConditionModel", unet),
    "sd15-unet": lambda sd, unet: _diffusers("UNet2DConditionModel", sd / "unet"),
    "sd15-vae": lambda sd, unet: _diffusers("AutoencoderKL", sd / "vae"),
    "clip-tokenizer": lambda sd, unet: _transformers("CLIPTokenizer", sd / "tokenizer"),
    "clip-text-model": lambda sd, unet: _transformers("CLIPTextModel", sd / "text_encoder"),
    "llama": lambda sd, unet: tiny_llama(),
    "sd15-pipeline": lambda sd, unet: _diffusers("StableDiffusionPipeline", sd),
}


def _diffusers(name: str, path: Path) -> Any:
    import diffusers

    return getattr(diffusers, name).from_pretrained(path)


def _transformers(name: str, path: Path) -> Any:
    import transformers

    return getattr(transformers, name).from_pretrained(path)


@pytest.mark.parametrize("name", list(REAL))
def test_real_models_are_not_flagged(name: str, sd15_dir: Path, tiny_unet_dir: Path) -> None:
    check(REAL[name](sd15_dir, tiny_unet_dir))


# -- through load ------------------------------------------------------------------------------
def test_a_self_removing_hook_is_loaded_uncached_with_one_warning(daemon: Client) -> None:
    with pytest.warns(OvermindWarning, match=r"not cached: `_forward_hooks\[once\]\.<locals>\."
                                             r"handle` is a hook handle") as caught:
        first = overmind_lab.load(self_removing_hook)
    assert len([w for w in caught if issubclass(w.category, OvermindWarning)]) == 1
    assert daemon.entries() == []
    with overmind_lab.record_loads() as events:
        again = overmind_lab.load(self_removing_hook)  # warned once: not again
    assert events[-1].outcome == "uncached"
    for model in (first, again):  # each a plain load's: the hook runs once
        model(torch.ones(1, 2))
        model(torch.ones(1, 2))
        assert dict(model._forward_hooks) == {}
