"""``docs/images/bench.svg``: the benchmark chart of the README, from a ``results.json``.

Plain SVG written by hand (no plotting library): on the left, for every load case that
was run, the median load call plain, cold (the first load through the cache, which
stores) and warm, on a log scale; on the right, the ``warm-kernel`` case: restart to the
first ``kernel_info_reply`` and the load cells right after a restart, plain vs warm
kernel. The caption names the run (date, machine, cases) and the summed PSS of the idle
kernels. Run: ``python -m benchmarks._chart RESULTS_JSON OUT_SVG [--note TEXT]``
(``make images-bench`` runs the benchmark and this).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from html import escape
from pathlib import Path
from typing import Any

__all__ = ["render", "main"]

COLORS = {"plain": "#8c8c8c", "cold": "#e0a030", "warm": "#2a7fd4"}
WIDTH, HEIGHT = 960, 470
TOP, BOTTOM = 64, 360  # plot area, y
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def _fmt(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"
    return f"{seconds:.1f} s"


def _text(x: float, y: float, s: str, size: int = 11, anchor: str = "middle",
          color: str = "#222", weight: str = "normal", rotate: float | None = None) -> str:
    rot = f" transform='rotate({rotate} {x:.1f} {y:.1f})'" if rotate is not None else ""
    return (f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' "
            f"fill='{color}' font-weight='{weight}' {FONT}{rot}>{escape(s)}</text>")


class _LogAxis:
    def __init__(self, values: list[float]) -> None:
        positive = [v for v in values if v > 0] or [1.0]
        # a decade below the smallest bar when it sits near a decade line (still visible)
        self.lo = 10 ** math.floor(math.log10(min(positive) / 3))
        self.hi = 10 ** math.ceil(math.log10(max(positive) * 1.05))

    def y(self, value: float) -> float:
        frac = (math.log10(max(value, self.lo)) - math.log10(self.lo)) / (
            math.log10(self.hi) - math.log10(self.lo))
        return BOTTOM - frac * (BOTTOM - TOP)

    def ticks(self) -> list[float]:
        out, t = [], self.lo
        while t <= self.hi * 1.0001:
            out.append(t)
            t *= 10
        return out


def _panel(x0: float, x1: float, title: str, groups: list[tuple[str, dict[str, float]]],
           modes: list[str]) -> list[str]:
    """Grouped bars (one group per label, one bar per mode present) on a log axis."""
    values = [v for _, g in groups for v in g.values()]
    if not values:
        return []
    axis = _LogAxis(values)
    out = [_text((x0 + x1) / 2, TOP - 22, title, 13, weight="bold")]
    for t in axis.ticks():
        y = axis.y(t)
        out.append(f"<line x1='{x0:.1f}' x2='{x1:.1f}' y1='{y:.1f}' y2='{y:.1f}' "
                   f"stroke='#ddd' stroke-width='1'/>")
        out.append(_text(x0 - 6, y + 4, _fmt(t), 10, anchor="end", color="#666"))
    out.append(f"<line x1='{x0:.1f}' x2='{x1:.1f}' y1='{BOTTOM}' y2='{BOTTOM}' stroke='#444'/>")
    slot = (x1 - x0) / len(groups)
    bar = min(26.0, slot * 0.8 / len(modes))
    for i, (label, g) in enumerate(groups):
        present = [m for m in modes if m in g]
        left = x0 + slot * i + (slot - bar * len(present)) / 2
        for j, mode in enumerate(present):
            x, y = left + j * bar, axis.y(g[mode])
            out.append(f"<rect x='{x:.1f}' y='{y:.1f}' width='{bar - 2:.1f}' "
                       f"height='{BOTTOM - y:.1f}' fill='{COLORS[mode]}'><title>{escape(label)} "
                       f"{mode}: {_fmt(g[mode])}</title></rect>")
            out.append(_text(x + (bar - 2) / 2, y - 4, _fmt(g[mode]), 9, anchor="start",
                             rotate=-90))
        lines = label.split("\n")
        for k, line in enumerate(lines):
            out.append(_text(x0 + slot * (i + 0.5), BOTTOM + 16 + 13 * k, line, 10))
    return out


def _median(case: dict[str, Any], mode: str) -> float | None:
    s = case.get("stats", {}).get(mode, {}).get("load")
    return None if not s else float(s["median"])


def _load_groups(results: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    groups = []
    for name, case in results.get("cases", {}).items():
        g = {}
        for mode, key in (("plain", "plain"), ("first", "cold"), ("warm", "warm")):
            v = _median(case, mode)
            if v is not None:
                g[key] = v
        if g:
            groups.append((case.get("title", name).replace(" -> ", " → ") + "\nload call", g))
    return groups


def _kernel_groups(wk: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    if not wk or wk.get("error"):
        return []
    sd, llama = wk.get("sd15", {}), wk.get("llama", {})
    groups = []
    for label, case, key in (("restart →\nkernel_info_reply", sd, "restart_seconds"),
                             ("SD 1.5 pipeline cell\nafter a restart", sd, "cell_seconds"),
                             ("Llama 1.1B cell\nafter a restart", llama, "cell_seconds")):
        g = {m: float(case[m][key]) for m in ("plain", "warm")
             if case.get(m, {}).get(key) is not None}
        if g:
            groups.append((label, g))
    return groups


def _caption(results: dict[str, Any], note: str | None) -> list[str]:
    meta = results.get("meta", {})
    first = (f"overmind-lab bench, {meta.get('started_iso', '')}: {meta.get('cpus')} CPUs "
             f"(shared), torch {meta.get('torch')}, medians of {meta.get('repeat')}; "
             f"cases: {', '.join(meta.get('cases', []))}.")
    second = ("plain: from_pretrained / a plain kernel; cold: the first load through the cache "
              "(stores it); warm: from the cache / a kernel forked from the zygote.")
    lines = [first, second]
    pss = (results.get("warm_kernel") or {}).get("pss")
    if pss:
        mib = 2**20
        lines.append(f"Summed PSS of {pss['kernels']} idle kernels: plain "
                     f"{pss['plain_sum_bytes'] / mib:.0f} MiB, warm "
                     f"{pss['warm_sum_bytes'] / mib:.0f} MiB "
                     f"({pss['warm_in_plain_kernels']:.2f} plain kernels; zygote "
                     f"{pss['zygote_pss_bytes'] / mib:.0f} MiB and standbys "
                     f"{sum(pss.get('standby_pss', [])) / mib:.0f} MiB more).")
    if note:
        lines.append(note)
    return lines


def render(results: dict[str, Any], note: str | None = None) -> str:
    """The chart as an SVG document."""
    loads = _load_groups(results)
    kernels = _kernel_groups(results.get("warm_kernel") or {})
    caption = _caption(results, note)
    height = HEIGHT + 15 * max(0, len(caption) - 3)
    body = [f"<rect width='{WIDTH}' height='{height}' fill='white'/>"]
    if loads and kernels:
        split = 70 + (WIDTH - 100) * len(loads) / (len(loads) + len(kernels) + 0.6)
        body += _panel(70, split - 20, "Load a model in a fresh process (log scale)",
                       loads, ["plain", "cold", "warm"])
        body += _panel(split + 60, WIDTH - 20, "Jupyter kernel restart (log scale)",
                       kernels, ["plain", "warm"])
    elif loads:
        body += _panel(70, WIDTH - 20, "Load a model in a fresh process (log scale)", loads,
                       ["plain", "cold", "warm"])
    elif kernels:
        body += _panel(70, WIDTH - 20, "Jupyter kernel restart (log scale)", kernels,
                       ["plain", "warm"])
    for i, mode in enumerate(("plain", "cold", "warm")):
        x = WIDTH - 250 + i * 80
        body.append(f"<rect x='{x}' y='12' width='12' height='12' fill='{COLORS[mode]}'/>")
        body.append(_text(x + 16, 22, mode, 11, anchor="start"))
    for i, line in enumerate(caption):
        body.append(_text(20, BOTTOM + 58 + 15 * i, line, 10, anchor="start", color="#444"))
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
            f"viewBox='0 0 {WIDTH} {height}'>\n" + "\n".join(body) + "\n</svg>\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._chart",
                                     description="Write the benchmark chart (SVG) of a results.json.")
    parser.add_argument("results", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--note", help="one more caption line")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text(encoding="utf-8"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, args.note), encoding="utf-8")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
