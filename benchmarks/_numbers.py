"""Small numeric helpers the benchmark's cases share: statistics of a run's values, ratios that
are ``None`` where a side is missing, seconds as the reports write them. The standard library
only (the measuring children import the cases' modules)."""

from __future__ import annotations

import statistics

__all__ = ["fmt", "median_or_none", "ratio", "stats"]


def stats(values: list[float]) -> dict[str, float | int] | None:
    """Median, min, max and count of ``values``; ``None`` for none."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; ``None`` where either is missing or ``b`` is zero."""
    return None if a is None or not b else a / b


def fmt(seconds: float | None, ms_digits: int = 1) -> str:
    """``12.3 ms`` below a second, ``1.23 s`` from one on, ``-`` for none."""
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.{ms_digits}f} ms" if seconds < 1 else f"{seconds:.2f} s"
