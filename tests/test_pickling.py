"""The lean rebuilds keep every layout: Note [One call per tensor] and Note [Modules in one
call] in ``overmind_lab/_client/pickling.py``, against a plain call of the same loader.

A real daemon; the result is small, so the cold load, too, returns the object rebuilt
from its new entry, and both loads go through the rebuild.
"""

from __future__ import annotations

from typing import Any

import torch

import overmind_lab
from overmind_lab import Client
from tests.loaders import Remembering, layouts


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(),
            t.untyped_storage().nbytes(), t.requires_grad, dict(t.__dict__))


def _sharing(result: dict[str, Any]) -> list[list[str]]:
    """Names of the tensors grouped by the storage they share."""
    groups: dict[int, list[str]] = {}
    for name, value in result.items():
        if isinstance(value, torch.Tensor) and value.numel():
            groups.setdefault(value.untyped_storage().data_ptr(), []).append(name)
    return sorted(groups.values())


def _fields(module: torch.nn.Module) -> list[list[str]]:
    return [[k for k in m.__dict__ if k != "_compiled_call_impl"] for m in module.modules()]


def test_every_tensor_and_module_layout_comes_back_as_a_plain_load_gives_it(
        daemon: Client) -> None:
    plain = layouts()
    calls = Remembering.setstate_calls
    with overmind_lab.record_loads() as events:
        results = [overmind_lab.load(layouts), overmind_lab.load(layouts)]
    assert [e.outcome for e in events] == ["cold", "warm"]
    assert Remembering.setstate_calls == calls + 2  # its own __setstate__ ran each time
    for result in results:
        assert result.keys() == plain.keys()
        for name, value in plain.items():
            if isinstance(value, torch.Tensor):
                assert _layout(result[name]) == _layout(value), name
                assert torch.equal(result[name], value), name
        assert _sharing(result) == _sharing(plain)

        model, reference = result["model"], plain["model"]
        assert _fields(model) == _fields(reference)  # the same fields, in the same order
        assert "_compiled_call_impl" not in model[0].__dict__
        assert model[1].weight is model[0].weight  # still tied
        assert model[2].parent is model  # the cycle is closed
        assert len(model.hooked._forward_hooks) == 1
        assert model.marked._forward_hooks_always_called == {7: True}
        for got, want in zip(model.modules(), reference.modules(), strict=True):
            for table in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                          "_state_dict_hooks", "_load_state_dict_post_hooks"):
                assert type(getattr(got, table)) is type(getattr(want, table))
            assert got._modules.keys() == want._modules.keys()
        x = torch.arange(8, dtype=torch.float32)
        assert torch.equal(model[:2](x), reference[:2](x))
    # Each load has its own hook tables: a hook registered on one is not on the other.
    results[0]["model"][0].register_forward_hook(lambda *a: None)
    assert not results[1]["model"][0]._forward_hooks
