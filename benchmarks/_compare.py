"""Does an object returned warm from the cache match a plain load? (runs in a child)

The answer is the fingerprint's (``overmind_lab/_common/fingerprint.py``), the one
definition of "equal to a plain load" that verify mode and the tests use too; this module
only shapes it for the report, with counts of what was compared.
"""

from __future__ import annotations

from typing import Any

from overmind_lab._common.fingerprint import differences, fingerprint

__all__ = ["compare"]

_MAX_FAILURES = 20


def compare(warm: Any, plain: Any) -> dict[str, Any]:
    """Compare *warm* (from the cache) with *plain* (a plain load). JSON-ready result."""
    found = fingerprint(warm)
    failures = []
    for text in differences(found, fingerprint(plain)):
        failures.append(text)
        if len(failures) >= _MAX_FAILURES:
            break
    tensors = [p for p, v in found.items() if " " not in p and v.startswith(
        ("torch.Tensor ", "torch.nn.parameter.Parameter "))]
    components = getattr(warm, "components", None)
    return {"passed": not failures, "failures": failures, "facts": len(found),
            "components": len(components) if isinstance(components, dict) else 0,
            "tensors": len(tensors),
            "storages": sum(1 for p, v in found.items()
                            if p.endswith(" storage") and v.startswith("storage ")),
            "modules": sum(1 for p, v in found.items() if v.startswith("torch.") and
                           " training " in v)}
