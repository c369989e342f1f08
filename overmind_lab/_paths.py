"""Where the daemon lives, and parsing of human sizes.

The socket sits in a 0700 per-user directory: ``$XDG_RUNTIME_DIR/overmind-lab/`` when that
is set and usable, else ``/tmp/overmind-lab-<uid>/``. ``OVERMIND_LAB_SOCKET`` overrides the
socket path (tests, benchmarks, several caches side by side).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

__all__ = ["socket_path", "runtime_dir", "ensure_private_dir", "parse_size", "format_size"]

SOCKET_ENV = "OVERMIND_LAB_SOCKET"
BUDGET_ENV = "OVERMIND_LAB_BUDGET"


def runtime_dir() -> Path:
    """The per-user directory that holds the default socket, lock and log."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg) / "overmind-lab"
    return Path(tempfile.gettempdir()) / f"overmind-lab-{os.getuid()}"


def socket_path(override: str | os.PathLike[str] | None = None) -> Path:
    """The daemon socket: ``override``, else ``$OVERMIND_LAB_SOCKET``, else the default."""
    if override is not None:
        return Path(override)
    env = os.environ.get(SOCKET_ENV)
    if env:
        return Path(env)
    return runtime_dir() / "daemon.sock"


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` as a 0700 directory owned by us, or refuse one that is not."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(
            f"{path} is not a directory owned by uid {os.getuid()}; "
            f"remove it or set {SOCKET_ENV} to a socket path in a directory you own"
        )
    if stat.S_IMODE(st.st_mode) & 0o077 and path.name.startswith("overmind-lab"):
        os.chmod(path, 0o700)


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


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[name] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def total_memory() -> int:
    """System RAM in bytes."""
    return _meminfo()["MemTotal"]


def available_memory() -> int:
    """Memory the kernel estimates is available for new allocations, in bytes."""
    info = _meminfo()
    return info.get("MemAvailable", info.get("MemFree", 0))
