"""Does an object returned warm from the cache match a plain load? (runs in a child)

Checked for a model: same type; same state_dict keys and, per tensor, same dtype, shape,
device and bytes (``torch.equal``, NaN-safe through a byte view); same ``requires_grad``
on every parameter; same training/eval mode on every submodule; same model dtype and
device. For a pipeline: the same for every component; non-module components (tokenizer,
scheduler) must have the same type and configuration.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compare"]

_MAX_FAILURES = 20


def _same_bytes(a: Any, b: Any) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    try:
        return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    except RuntimeError:  # dtypes without a byte view
        return bool(torch.equal(a, b))


def _compare_module(a: Any, b: Any, where: str, checks: dict[str, bool], failures: list[str],
                    counts: dict[str, int]) -> None:
    def fail(check: str, message: str) -> None:
        checks[check] = False
        if len(failures) < _MAX_FAILURES:
            failures.append(f"{where}: {message}")

    sa, sb = a.state_dict(), b.state_dict()
    if list(sa) != list(sb):
        fail("state_dict", f"state_dict keys differ ({len(sa)} vs {len(sb)})")
    for name in sa.keys() & sb.keys():
        ta, tb = sa[name], sb[name]
        counts["tensors"] += 1
        counts["bytes"] += ta.numel() * ta.element_size()
        if ta.dtype != tb.dtype:
            fail("dtype", f"{name}: dtype {ta.dtype} vs {tb.dtype}")
        if ta.device != tb.device:
            fail("device", f"{name}: device {ta.device} vs {tb.device}")
        if not _same_bytes(ta, tb):
            fail("state_dict", f"{name}: tensor bytes differ")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        fail("requires_grad", "named_parameters differ")
    for name in pa.keys() & pb.keys():
        counts["parameters"] += 1
        if pa[name].requires_grad != pb[name].requires_grad:
            fail("requires_grad", f"{name}: requires_grad {pa[name].requires_grad} vs {pb[name].requires_grad}")
    ma, mb = dict(a.named_modules()), dict(b.named_modules())
    if ma.keys() != mb.keys():
        fail("training", "submodules differ")
    for name in ma.keys() & mb.keys():
        counts["modules"] += 1
        if ma[name].training != mb[name].training:
            fail("training", f"{name or '<root>'}: training {ma[name].training} vs {mb[name].training}")
    for attr, check in (("dtype", "dtype"), ("device", "device")):
        va, vb = getattr(a, attr, None), getattr(b, attr, None)
        if va != vb:
            fail(check, f"model {attr} {va} vs {vb}")


#: Configuration entries whose order is not meaningful (diffusers builds
#: ``_use_default_values`` from a set: its order changes with each process's hash seed).
_UNORDERED_CONFIG_KEYS = frozenset({"_use_default_values"})


def _config_of(obj: Any) -> Any:
    config = getattr(obj, "config", None)
    if config is not None:
        return {k: (sorted(map(str, v)) if k in _UNORDERED_CONFIG_KEYS and isinstance(v, (list, tuple, set))
                    else v)
                for k, v in dict(config).items()}
    if hasattr(obj, "get_vocab"):
        return {"vocab": obj.get_vocab(), "init": getattr(obj, "init_kwargs", None)}
    return None


def compare(warm: Any, plain: Any) -> dict[str, Any]:
    """Compare *warm* (from the cache) with *plain* (a plain load). JSON-ready result."""
    import torch

    checks = {"type": True, "state_dict": True, "requires_grad": True, "training": True,
              "dtype": True, "device": True, "config": True}
    failures: list[str] = []
    counts = {"tensors": 0, "bytes": 0, "parameters": 0, "modules": 0, "components": 0}

    def fail(check: str, message: str) -> None:
        checks[check] = False
        if len(failures) < _MAX_FAILURES:
            failures.append(message)

    def visit(a: Any, b: Any, where: str) -> None:
        if type(a) is not type(b):
            fail("type", f"{where}: type {type(a).__qualname__} vs {type(b).__qualname__}")
            return
        if isinstance(a, torch.nn.Module):
            _compare_module(a, b, where, checks, failures, counts)
            return
        if isinstance(a, torch.Tensor):
            counts["tensors"] += 1
            if not _same_bytes(a, b):
                fail("state_dict", f"{where}: tensor differs")
            return
        components = getattr(a, "components", None)
        if isinstance(components, dict):
            other = getattr(b, "components", {})
            if components.keys() != other.keys():
                fail("type", f"{where}: components {sorted(components)} vs {sorted(other)}")
            for name in sorted(components.keys() & other.keys()):
                counts["components"] += 1
                visit(components[name], other[name], f"{where}.{name}")
            return
        if a is None:
            return
        ca, cb = _config_of(a), _config_of(b)
        if ca != cb:
            if isinstance(ca, dict) and isinstance(cb, dict):
                keys = sorted(k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k))
                fail("config", f"{where}: configuration differs in {', '.join(map(str, keys[:8]))}")
            else:
                fail("config", f"{where}: configuration differs")

    visit(warm, plain, type(warm).__name__)
    return {"passed": all(checks.values()), "checks": checks, "failures": failures, **counts}
