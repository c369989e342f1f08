"""Module-level loaders for tests (child processes import them by name)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

#: A file that ``counted_load`` waits for, after its mark, while this variable names one
#: that does not exist (at most 10 minutes): a process held inside the call until the test
#: says so. The environment is not part of the key: a held call and a quick one share it.
LOAD_GATE_ENV = "OVERMIND_LAB_TEST_LOAD_GATE"


def counted_load(delay: float, counter: str) -> dict[str, Any]:
    """Append one mark to ``counter`` per real call, wait ``delay`` seconds (and for
    ``$OVERMIND_LAB_TEST_LOAD_GATE``), return data.

    ``delay`` comes first: the first positional argument of a loader is its source, and
    the counter file (which changes on every call) must not be one.
    """
    import os

    with open(counter, "a") as f:
        f.write("x")
    time.sleep(delay)
    gate = os.environ.get(LOAD_GATE_ENV)
    deadline = time.monotonic() + 600
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"w": torch.ones(3, 4096)}


def sized_load(nbytes: int, tag: str) -> torch.Tensor:
    """A tensor of ``nbytes`` bytes (``tag`` only makes distinct keys)."""
    return torch.full((nbytes // 4,), float(len(tag)), dtype=torch.float32)


def read_size(path: str) -> int:
    return Path(path).stat().st_size


def base_weights() -> torch.nn.Module:
    """A component (modules can be weakly referenced, so the cache remembers its key)."""
    # skip_init: no random draw (a load that draws random numbers is not cached)
    layer = torch.nn.utils.skip_init(torch.nn.Linear, 256, 256, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(256 * 256, dtype=torch.float32).view(256, 256))
    return layer


def wrap(component: torch.nn.Module, extra: int) -> dict[str, Any]:
    """A 'pipeline' that holds a component passed in, plus weights of its own."""
    return {"component": component, "own": torch.zeros(extra)}


def borrow(component: torch.nn.Module, extra: int) -> dict[str, Any]:
    """A result that holds a component's tensor (not the component itself)."""
    return {"weight": component.weight, "own": torch.zeros(extra)}


def load_named_file(name: str) -> dict[str, torch.Tensor]:
    """The safetensors file ``$OVERMIND_LAB_TEST_FILE`` as is (mapped, not copied).

    Its key does not cover the file (``name`` is no path), so only the daemon's check of
    the referenced file can tell that the file changed.
    """
    import os

    from safetensors.torch import load_file

    return load_file(os.environ["OVERMIND_LAB_TEST_FILE"])


def noisy_load(n: int) -> torch.Tensor:
    """A loader that warns and logs, as libraries do ("Some weights of ... were not ...")."""
    import logging
    import warnings

    warnings.warn(f"noisy_load: {n} values are made up", UserWarning, stacklevel=2)
    # Two records in a row, as diffusers logs an ERROR and then a WARNING when a
    # safetensors file is missing: the first is freed before the second is made.
    logger = logging.getLogger("transformers.modeling_utils")
    logger.error("noisy_load could not fetch %d", n)
    logger.warning("noisy_load logged %d", n)
    return torch.ones(n)


#: A knob that ``scaled_load`` reads but its key cannot see: changing it between two
#: loads is a difference that only verify mode can catch.
HIDDEN_SCALE = [1.0]


def scaled_load(n: int) -> torch.Tensor:
    return torch.full((n,), HIDDEN_SCALE[0])


def failing_load(path: str, option: object = None) -> torch.Tensor:
    raise ValueError(f"cannot load {path}")


#: A file that pickling a ``SlowToPickle`` waits for while this variable names one that
#: does not exist: read when it is pickled, so that a test can hold a store open until it
#: creates the file (an event it controls, not a sleep that a loaded machine can outlast),
#: without changing the load's key.
PICKLE_GATE_ENV = "OVERMIND_LAB_TEST_PICKLE_GATE"


class SlowToPickle:
    """Pickles once ``$OVERMIND_LAB_TEST_PICKLE_GATE`` exists (a store in progress until
    then; at most 10 minutes, so that a failed test leaves no store behind for long)."""

    def __getstate__(self) -> dict[str, Any]:
        import os

        gate = os.environ.get(PICKLE_GATE_ENV)
        deadline = time.monotonic() + 600
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        pass


class Counting(torch.nn.Module):
    """``n`` float32 weights 0, 1, ..., n - 1, and an attribute that is slow to pickle."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(n, dtype=torch.float32))
        self.slow = SlowToPickle()


def counting_module(n: int) -> Counting:
    return Counting(n)


def unpicklable_module(n: int) -> torch.nn.Module:
    """A module with a generator attribute: neither pickle nor dill can store it."""
    module = Counting(n)
    module.source = (i for i in range(n))
    return module


def _identity_hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return output


class Remembering(torch.nn.Module):
    """A module with its own pickling hook (a custom
    ``__setstate__``, which counts its calls), and points back at its parent (a cycle
    through the module tree)."""

    setstate_calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        Remembering.setstate_calls += 1


def layouts() -> dict[str, Any]:
    """Tensors and modules in every layout the lean rebuilds must keep exactly: shared
    and tied storages, views at an offset, transposed and size-1 strides, empty tensors,
    dtypes numpy lacks, two dtypes over one storage, attributes on a tensor, modules
    with a hook, a custom ``__setstate__``, a cycle and a compiled-call slot."""
    base = torch.arange(48, dtype=torch.float32).view(6, 8) * 0.5
    linear = torch.nn.utils.skip_init  # no random draw (such loads are not cached)
    model = torch.nn.Sequential(linear(torch.nn.Linear, 8, 8), linear(torch.nn.Linear, 8, 8),
                                Remembering())
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view_as(p) * (i + 1))
    model[1].weight = model[0].weight  # tied: one Parameter twice
    model[2].parent = model  # a cycle
    hooked = linear(torch.nn.Linear, 2, 2)
    with torch.no_grad():
        hooked.weight.fill_(1.0)
        hooked.bias.fill_(0.0)
    hooked.register_forward_hook(_identity_hook)
    model.add_module("hooked", hooked)
    marked = linear(torch.nn.Linear, 2, 2)
    with torch.no_grad():
        for p in marked.parameters():
            p.fill_(2.0)  # skip_init leaves whatever the allocator had
    marked._forward_hooks_always_called[7] = True  # one table, not the ones beside it
    model.add_module("marked", marked)
    model[0]._compiled_call_impl = None  # dropped by Module.__getstate__
    attributed = base[1].clone()
    attributed.note = "kept"
    alone = torch.arange(5, dtype=torch.int64)
    return {
        "model": model,
        "base": base,
        "row": base[2],  # a view at a storage offset
        "columns": base.t(),  # transposed
        "narrow": base[:, 1:3],
        "unit": base[3:4].unsqueeze(0),  # size-1 dimensions
        "as_bytes": base.view(torch.uint8),  # another dtype over the same storage
        "alone": alone,
        "alone_again": alone.detach(),  # another tensor over the whole of the same storage
        "bf16": torch.arange(7, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "flags": torch.tensor([True, False, True]),
        "grad": torch.ones(4, requires_grad=True),
        "param": torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False),
        "attributed": attributed,
    }


def hooked_model() -> torch.nn.Module:
    """A module whose loader registers hooks (ids from torch's process-wide counter)."""
    for _ in range(5):  # the loading process has registered hooks of its own before
        torch.nn.Identity().register_forward_hook(_identity_hook)
    model = torch.nn.utils.skip_init(torch.nn.Linear, 2, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.register_forward_hook(_identity_hook)
    model.register_forward_pre_hook(_identity_pre_hook)
    return model


def _identity_pre_hook(module: torch.nn.Module, args: Any) -> None:
    return None


def weight_normed(n: int) -> torch.nn.Module:
    """A module with a parametrization: torch refuses to pickle it (``RuntimeError``)."""
    layer = torch.nn.utils.skip_init(torch.nn.Linear, n, n)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(n * n, dtype=torch.float32).view(n, n))
        layer.bias.zero_()
    return torch.nn.utils.parametrizations.weight_norm(layer)


FINALISED: list[int] = []


class Finalised(torch.nn.Module):
    """Records when it is finalised (a plain load's result lives as long as the caller
    holds it)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.register_buffer("w", torch.zeros(n))

    def __del__(self) -> None:
        FINALISED.append(self.n)


def finalised(n: int) -> Finalised:
    return Finalised(n)


def tokenizer_held_twice(path: str, hold: str) -> dict[str, Any]:
    """A CLIP tokenizer and, beside it, a second reference into what its Rust tokenizer holds:
    the tokenizer itself (``backend``) or its ``decode`` wrapper (``decode``)."""
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(path)
    other = tok._tokenizer if hold == "backend" else tok._tokenizer.decode
    return {"tok": tok, "other": other}
