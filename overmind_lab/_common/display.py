"""Human formatting shared by the magics, the widget and the examples: binary sizes, durations at a
glance (``48 ms``, ``3 min 05 s``), tables as aligned text or HTML. No torch."""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Sequence
from typing import Any

from overmind_lab._common.messages import EntryJson, Status
from overmind_lab._common.sizes import format_size

__all__ = [
    "StatusReport",
    "describe_load",
    "entry_row",
    "entry_speedup",
    "format_ago",
    "format_bytes",
    "format_seconds",
    "format_speedup",
    "html_table",
    "status_line",
    "text_table",
]


def format_bytes(n: float | None) -> str:
    """``1536 -> '1.5 KiB'``; ``None`` (unknown) -> ``'-'``."""
    return "-" if n is None else format_size(n)


def format_seconds(seconds: float | None) -> str:
    """``0.0481 -> '48 ms'``, ``2.913 -> '2.91 s'``, ``185 -> '3 min 05 s'``.

    >>> format_seconds(0.05)
    '0.05 s'
    """
    if seconds is None:
        return "-"
    if seconds < 0.01:
        return f"{seconds * 1000:.2g} ms"
    if seconds < 60:
        return f"{seconds:.3g} s" if seconds >= 10 else f"{seconds:.2f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def format_speedup(cold: float | None, warm: float | None) -> str:
    """How many times faster the warm load was: ``'41x'``, ``'3.0x'``; slower keeps two significant
    digits (``'0.25x'``), never ``'0.0x'``; ``''`` when not meaningful."""
    if not cold or not warm or warm <= 0 or cold <= 0:
        return ""
    ratio = cold / warm
    if ratio >= 10:
        return f"{ratio:.0f}x"
    if ratio >= 1:
        return f"{ratio:.1f}x"
    return f"{ratio:.2g}x"


def entry_speedup(entry: EntryJson) -> str:
    """An entry's speed-up: cold over ``warm_median_seconds``; ``''`` before a warm load."""
    return format_speedup(entry.get("cold_seconds"), entry.get("warm_median_seconds"))


def format_ago(epoch: float | None, now: float | None = None) -> str:
    """``'12 s ago'``, ``'3 min ago'``: for ``created`` / ``last_used`` stamps."""
    if not epoch:
        return "-"
    delta = max(0.0, (time.time() if now is None else now) - epoch)
    if delta < 60:
        return f"{delta:.0f} s ago"
    if delta < 3600:
        return f"{delta / 60:.0f} min ago"
    if delta < 86400:
        return f"{delta / 3600:.1f} h ago"
    return f"{delta / 86400:.1f} days ago"


def describe_load(event: Any, *, name: bool = True) -> str:
    """One line for a ``LoadEvent``, e.g. ``warm 0.05 s (cold load was 2.91 s, 41x)``, then the
    callable and its main argument after two spaces (``name=False``: without them).

    The cold time a warm line compares with is the entry's ``cold_seconds``: the loader's own time
    in the process that cached it, without storing; a cold line therefore shows its parts. A load
    that had to start the daemon shows that apart (Note [What a load's times say] in
    ``_loading/load.py``), and a hit slower than the cold load says so, never as a speed-up.

    >>> from overmind_lab import LoadEvent
    >>> describe_load(LoadEvent("k", "M.from_pretrained('/m')", "cold", 0.22, cold_seconds=0.13))
    "cold 0.22 s (load 0.13 s + cache it 0.09 s), now cached  M.from_pretrained('/m')"
    """
    outcome = getattr(event, "outcome", "?")
    own = getattr(event, "seconds", None)
    daemon = getattr(event, "daemon_seconds", None)
    total = None if own is None else own + (daemon or 0.0)
    seconds = format_seconds(total)
    cold = getattr(event, "cold_seconds", None)
    reason = getattr(event, "reason", None)
    started = f"start the cache daemon {format_seconds(daemon)}"
    if outcome == "warm":
        compared = _compared(cold, own)
        if daemon:
            inner = f"{started} + hit {format_seconds(own)}" + (f"; {compared}" if compared else "")
            text = f"warm {seconds} ({inner})"
        else:
            text = f"warm {seconds}" + (f" ({compared})" if compared else "")
        if getattr(event, "verified", None):
            text += ", verified equal to a plain load"
    elif outcome == "cold":
        parts = [started] if daemon else []
        if cold is not None and own is not None:
            parts += [f"load {format_seconds(cold)}",
                      f"cache it {format_seconds(max(own - cold, 0.0))}"]
        inner = f" ({' + '.join(parts)})" if parts else ""
        text = f"cold {seconds}{inner}, {reason or 'now cached'}"
    elif outcome == "bypass":
        text = f"cold {seconds} (cache bypassed)"
    elif outcome == "uncached":
        text = f"loaded {seconds}, not cached" + (f": {reason}" if reason else "")
    elif outcome == "fallback":
        text = f"loaded {seconds} without the cache" + (f": {reason}" if reason else "")
    else:
        text = f"{outcome} {seconds}" + (f": {reason}" if reason else "")
    called = getattr(event, "name", None) if name else None
    return f"{text}  {called}" if called else text


def _compared(cold: float | None, warm: float | None) -> str:
    """``'cold load was 2.91 s, 41x'``; a hit slower than the cold load: ``'cold load was 0.13 s,
    this hit 4.8x slower'``; ``''`` without a cold time."""
    if not cold:
        return ""
    text = f"cold load was {format_seconds(cold)}"
    if not warm or warm <= 0:
        return text
    if warm > cold:
        return f"{text}, this hit {warm / cold:.2g}x slower"
    return f"{text}, {format_speedup(cold, warm)}"


def _cells(rows: Iterable[Sequence[object]]) -> list[list[str]]:
    return [["" if c is None else str(c) for c in row] for row in rows]


def text_table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], *, right: Sequence[int] = ()
) -> str:
    """An aligned plain-text table; columns whose index is in ``right`` align right."""
    body = _cells(rows)
    widths = [len(h) for h in headers]
    for row in body:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(row) for row in body)
    return "\n".join(out)


def html_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    right: Sequence[int] = (),
    titles: Sequence[str | None] | None = None,
) -> str:
    """An HTML table, every cell escaped; ``titles`` become first-cell tooltips."""
    body = _cells(rows)
    style = ' style="text-align:right"'
    head = "".join(
        f"<th{style if i in right else ''}>{html.escape(h)}</th>" for i, h in enumerate(headers)
    )
    trs = []
    for r, row in enumerate(body):
        tds = []
        for i, cell in enumerate(row):
            title = titles[r] if titles is not None and i == 0 else None
            attr = f' title="{html.escape(title)}"' if title else ""
            tds.append(f"<td{attr}{style if i in right else ''}>{html.escape(cell)}</td>")
        trs.append("<tr>" + "".join(tds) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(trs)}</tbody></table>"


ENTRY_HEADERS = ("name", "size", "shared", "held", "hits", "cold", "warm", "speedup",
                  "holders", "last used")


def _hits(entry: EntryJson) -> str:
    """``"5"``, or ``"5 (3 verified)"`` when verify mode compared some of them."""
    hits, verified = entry.get("hits", 0), entry.get("verified", 0)
    return f"{hits} ({verified} verified)" if verified else str(hits)


def entry_row(entry: EntryJson, now: float | None = None) -> list[str]:
    """The cells of one entry in `ENTRY_HEADERS` order ("warm": the recent warm median)."""
    holders = entry.get("holders") or []
    return [
        str(entry.get("name", entry.get("key", "?"))),
        format_bytes(entry.get("bytes")),
        format_bytes(entry.get("shared_bytes")) if entry.get("shared_bytes") else "-",
        format_bytes(entry.get("held_bytes")) if entry.get("held_bytes") else "-",
        _hits(entry),
        format_seconds(entry.get("cold_seconds")),
        format_seconds(entry.get("warm_median_seconds")),
        entry_speedup(entry) or "-",
        ", ".join(str(p) for p in holders) if holders else "-",
        format_ago(entry.get("last_used"), now),
    ]


def status_line(status: Status) -> str:
    """``daemon pid 8824 on /run/...sock: 5 entries, 27.5 MiB of 11.8 GiB ...``: the one rendering
    of a status as a line (magics, widget, ``%overmind_status``)."""
    if status.get("not_answering"):
        return str(status.get("error"))
    if not status.get("running"):
        error = status.get("error")
        return (
            f"no daemon is running on {status.get('socket')}: the first cached load starts "
            "one" + (f" ({error})" if error else "")
        )
    return (
        f"daemon pid {status.get('pid')} on {status.get('socket')}: "
        f"{status.get('entries', 0)} entries, {format_bytes(status.get('cached_bytes'))} "
        f"cached of {format_bytes(status.get('budget_bytes'))} budget, "
        + (f"held: {format_bytes(status.get('held_bytes'))} of your own files, "
           if status.get("held_bytes") else "")
        + f"{format_bytes(status.get('memory_available_bytes'))} of "
        f"{format_bytes(status.get('memory_total_bytes'))} system memory available"
    )


class StatusReport:
    """The daemon status and its entries, as HTML or aligned text; ``%overmind_status`` returns one
    (``.status``, ``.entries``: the daemon's JSON)."""

    def __init__(self, status: Status, entries: list[EntryJson]) -> None:
        self.status = status
        self.entries = entries

    def rows(self) -> list[list[str]]:
        now = time.time()
        return [entry_row(e, now) for e in self.entries]

    def __repr__(self) -> str:
        lines = [status_line(self.status)]
        if self.entries:
            lines += ["", text_table(ENTRY_HEADERS, self.rows(), right=(1, 2, 3, 4, 5, 6, 7))]
        elif self.status.get("running"):
            lines.append("the cache is empty")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = [f"<p>{html.escape(status_line(self.status))}</p>"]
        if self.entries:
            titles = [str(e.get("key", "")) for e in self.entries]
            parts.append(
                html_table(ENTRY_HEADERS, self.rows(), right=(1, 2, 3, 4, 5, 6, 7), titles=titles)
            )
        elif self.status.get("running"):
            parts.append("<p>the cache is empty</p>")
        return "<div class=\"overmind-status\">" + "".join(parts) + "</div>"
