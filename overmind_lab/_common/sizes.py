"""Sizes: parsing and formatting human sizes, the system's memory (``/proc/meminfo``), and
durations from the environment (``env_seconds``)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["parse_size", "format_size", "meminfo", "total_memory", "available_memory",
           "env_seconds"]


def env_seconds(name: str, default: float, env: Mapping[str, str] | None = None, *,
                zero: bool = False) -> float:
    """Seconds from the variable ``name`` of ``env`` (default: this process's environment);
    ``default`` when it is unset, not a number, negative, or 0 where ``zero`` is false."""
    try:
        value = float((os.environ if env is None else env).get(name, default))
    except ValueError:
        return default
    return value if value > 0 or (zero and value == 0) else default

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse ``"12GiB"``, ``"500MB"``, ``"1.5G"``, ``"40%"`` (of system RAM) or bytes.

    >>> parse_size("2KiB")
    2048
    """
    if isinstance(text, int):
        return text
    s = text.strip()
    if s.endswith("%"):
        try:
            frac = float(s[:-1]) / 100.0
        except ValueError:
            frac = -1.0
        if not 0 < frac <= 1:
            raise ValueError(f"invalid budget {text!r}: a percentage must be in (0, 100]")
        return int(total_memory() * frac)
    m = _SIZE_RE.match(s)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: use a number with a unit such as 12GiB, 500MB or 40%"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units, three significant digits."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where it cannot be read)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[name] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except (OSError, ValueError):
        pass
    return out


def total_memory() -> int:
    """System RAM in bytes."""
    return meminfo()["MemTotal"]


def available_memory() -> int:
    """Memory the kernel estimates is available for new allocations, in bytes."""
    info = meminfo()
    return info.get("MemAvailable", info.get("MemFree", 0))
