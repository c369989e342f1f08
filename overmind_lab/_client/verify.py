"""Verify mode: is a warm hit the same as a plain load? Find the first difference.

``difference(warm, plain)`` walks both results side by side and describes the first
place where they differ, e.g. ``config._attn_implementation_internal: 'eager' vs
'sdpa'``, or returns ``None``. It compares what a user can observe: the class of every
object, each tensor's bytes, dtype, device, shape and ``requires_grad``, every module's
``training`` flag, configs with their private fields, tokenizers' vocabularies and
serialized state, and plain containers and attributes, recursively.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["difference"]

_MAX_DEPTH = 12
_MAX_REPR = 80


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 1] + "…"


def _qual(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _join(path: str, part: str) -> str:
    if not path:
        return part.lstrip(".")
    return path + part


def difference(warm: Any, plain: Any, path: str = "") -> str | None:
    """The first difference between two load results, described; ``None`` if equal."""
    return _diff(warm, plain, path, 0, set())


def _diff(a: Any, b: Any, path: str, depth: int, seen: set[tuple[int, int]]) -> str | None:
    where = path or "the result"
    if type(a) is not type(b):
        return f"{where}: class {_qual(a)} vs {_qual(b)}"
    if a is b or depth > _MAX_DEPTH or (id(a), id(b)) in seen:
        return None
    seen.add((id(a), id(b)))
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(a, torch.Tensor):
            return _tensor_diff(torch, a, b, where)
        if isinstance(a, torch.nn.Module):
            return _module_diff(torch, a, b, path, depth, seen)
        if isinstance(a, (torch.dtype, torch.device)):
            return None if a == b else f"{where}: {a} vs {b}"
    if isinstance(a, (str, bytes, int, float, bool, type(None))):
        return None if _equal_scalar(a, b) else f"{where}: {_short(a)} vs {_short(b)}"
    if isinstance(a, list) and path.endswith("['_use_default_values']"):
        # diffusers builds this list from a set: its order is salted per process, and
        # two plain loads in two processes differ in it as much as a warm one does.
        a, b = sorted(map(str, a)), sorted(map(str, b))
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} items vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _diff(x, y, f"{path}[{i}]", depth + 1, seen)
            if found:
                return found
        return None
    if isinstance(a, dict):
        return _mapping_diff(a, b, path, depth, seen)
    if isinstance(a, type):
        return None if a is b else f"{where}: {a!r} vs {b!r}"
    if callable(getattr(a, "get_vocab", None)):
        return _tokenizer_diff(a, b, path, depth, seen)
    return _attributes_diff(a, b, path, depth, seen)


def _equal_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, float) and a != a and b != b:  # NaN == NaN here
        return True
    return bool(a == b)


def _mapping_diff(a: dict[Any, Any], b: dict[Any, Any], path: str, depth: int,
                  seen: set[tuple[int, int]]) -> str | None:
    if set(a) != set(b):
        only_a = sorted(map(repr, set(a) - set(b)))[:3]
        only_b = sorted(map(repr, set(b) - set(a)))[:3]
        return f"{path or 'the result'}: keys {only_a} only warm, {only_b} only plain"
    for key in a:
        found = _diff(a[key], b[key], f"{path}[{key!r}]", depth + 1, seen)
        if found:
            return found
    return None


def _attributes_diff(a: Any, b: Any, path: str, depth: int,
                     seen: set[tuple[int, int]]) -> str | None:
    state_a, state_b = getattr(a, "__dict__", None), getattr(b, "__dict__", None)
    if not isinstance(state_a, dict) or not isinstance(state_b, dict):
        try:
            equal = bool(a == b)
        except Exception:  # noqa: BLE001 - objects that cannot compare are opaque here
            return None
        return None if equal else f"{path or 'the result'}: {_short(a)} vs {_short(b)}"
    names = set(state_a) | set(state_b)
    for name in sorted(names):
        if name not in state_a or name not in state_b:
            side = "plain" if name in state_b else "warm"
            return f"{_join(path, '.' + name)}: only in the {side} result"
        if callable(state_a[name]) and not isinstance(state_a[name], type) \
                and not hasattr(state_a[name], "__dict__"):
            continue  # bound methods, builtins: behaviour, compared through their owner
        found = _diff(state_a[name], state_b[name], _join(path, "." + name), depth + 1, seen)
        if found:
            return found
    return None


def _tensor_diff(torch: Any, a: Any, b: Any, where: str) -> str | None:
    for what in ("dtype", "device", "shape", "requires_grad"):
        va, vb = getattr(a, what), getattr(b, what)
        if va != vb:
            return f"{where}: {what} {va} vs {vb}"
    if a.is_meta or b.is_meta:
        return None
    ba = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(ba, bb):
        return f"{where}: the tensor's bytes differ"
    return None


def _module_diff(torch: Any, a: Any, b: Any, path: str, depth: int,
                 seen: set[tuple[int, int]]) -> str | None:
    prefix = path + "." if path else ""
    state_a, state_b = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    if list(state_a) != list(state_b):
        return _mapping_diff(dict.fromkeys(state_a), dict.fromkeys(state_b),
                             prefix + "state_dict", depth, seen)
    for name in state_a:
        found = _tensor_diff(torch, state_a[name], state_b[name], f"{prefix}{name}")
        if found:
            return found
    for (name, ma), (_, mb) in zip(a.named_modules(), b.named_modules(), strict=False):
        if ma.training != mb.training:
            return f"{prefix}{name or 'module'}.training: {ma.training} vs {mb.training}"
    for attr in ("config", "generation_config", "peft_config", "hf_device_map"):
        if hasattr(a, attr) or hasattr(b, attr):
            found = _diff(getattr(a, attr, None), getattr(b, attr, None),
                          f"{prefix}{attr}", depth + 1, seen)
            if found:
                return found
    return None


def _tokenizer_diff(a: Any, b: Any, path: str, depth: int,
                    seen: set[tuple[int, int]]) -> str | None:
    where = path or "the tokenizer"
    if a.get_vocab() != b.get_vocab():
        return f"{where}: vocabularies differ"
    if _serialized(a) != _serialized(b):
        return f"{where}: the serialized tokenizers differ"
    skip = {"_tokenizer", "backend_tokenizer"}
    state_a = {k: v for k, v in getattr(a, "__dict__", {}).items() if k not in skip}
    state_b = {k: v for k, v in getattr(b, "__dict__", {}).items() if k not in skip}
    if set(state_a) != set(state_b):
        return _mapping_diff(state_a, state_b, path, depth, seen)
    for key in sorted(state_a):
        found = _diff(state_a[key], state_b[key], _join(path, "." + key), depth + 1, seen)
        if found:
            return found
    return None


def _serialized(tokenizer: Any) -> str | None:
    """A fast tokenizer's complete state as JSON (``tokenizers.Tokenizer.to_str``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer",
                                                                        None)
    to_str = getattr(backend, "to_str", None)
    return str(to_str()) if callable(to_str) else None
