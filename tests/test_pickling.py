"""The lean rebuilds keep every layout: Note [One call per tensor] and Note [Modules in one
call] in ``overmind_lab/_loading/pickling.py``, against a plain call of the same loader.

A real daemon; the cold load returns the loader's own object (Note [Never worse than
plain]), the warm one goes through the rebuild; both must have the plain load's
fingerprint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import overmind_lab
from overmind_lab import Client
from overmind_lab._common.fingerprint import RESIZABLE, difference, fingerprint
from overmind_lab._loading.pickling import hook_counter, set_hook_counter
from tests.conftest import last_json, run_py
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
        cold = overmind_lab.load(layouts)
        counter = hook_counter()
        results = [cold, overmind_lab.load(layouts)]
    assert [e.outcome for e in events] == ["cold", "warm"]
    assert Remembering.setstate_calls == calls + 1  # the warm rebuild ran its __setstate__
    set_hook_counter(counter)  # a plain load now takes the hook ids the warm one took
    # every fact, the address modulo 64 included; resizability is the one intended difference
    assert difference(fingerprint(results[1]), fingerprint(layouts()),
                      ignore=frozenset({RESIZABLE})) is None
    for result in results:
        assert result.keys() == plain.keys()
        for name, value in plain.items():
            if isinstance(value, torch.Tensor):
                assert _layout(result[name]) == _layout(value), name
                assert torch.equal(result[name], value), name
        assert _sharing(result) == _sharing(plain)

        model, reference = result["model"], plain["model"]
        assert _fields(model) == _fields(reference)  # the same fields, in the same order
        if result is results[1]:  # the rebuilt one: dropped, as Module.__getstate__ does
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


HOOKED = """
import json, sys, overmind_lab
sys.path.insert(0, {here!r})
from tests.loaders import hooked_model
with overmind_lab.record_loads() as events:
    model = overmind_lab.load(hooked_model)
added = model.register_forward_pre_hook(lambda *args: None)
print(json.dumps({{"outcome": events[-1].outcome, "hooks": list(model._forward_hooks),
                  "pre": list(model._forward_pre_hooks), "added": added.id}}))
"""


def test_hook_ids_of_a_warm_hit_are_those_a_plain_load_gives_in_a_fresh_process(
        daemon: Client) -> None:
    # Note [Hook ids]: the loader takes ids 5 and 6 of a fresh process's counter; the
    # user's next hook gets 7, warm or cold, and replaces nothing.
    here = str(Path(__file__).resolve().parent.parent)
    cold, warm = (last_json(run_py(HOOKED.format(here=here))) for _ in range(2))
    assert cold == {"outcome": "cold", "hooks": [5], "pre": [6, 7], "added": 7}
    assert warm == dict(cold, outcome="warm")
