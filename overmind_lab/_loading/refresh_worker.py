"""The refresh worker: ``python -m overmind_lab._loading.refresh_worker``.

The daemon's ``Refresher`` (``overmind_lab._daemon.refresh``) starts this process with the
interpreter that first stored the entry and sends the recorded call as JSON on stdin. It replays the
call inside ``refreshing()``, so the load reads the source again and stores under the key it
computes now, and prints one JSON line: ``{"ok": true, "key": ...}`` or ``{"ok": false, "error":
...}``.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

from overmind_lab._common.messages import RefreshJob, RefreshResult

__all__ = ["worker"]


def _import_callable(path: str) -> Any:
    module_name, _, qual = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def worker() -> int:
    request: RefreshJob = json.load(sys.stdin)
    call = request["call"]
    for p in reversed(call.get("sys_path", [])):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        from overmind_lab._loading.keys import revive
        from overmind_lab._loading.load import load, record_loads, refreshing

        fn = _import_callable(call["callable"])
        args = revive(call.get("args", []))
        kwargs = revive(call.get("kwargs", {}))
        with refreshing(), record_loads() as events:
            load(fn, *args, **kwargs)
    except Exception as exc:  # reported to the daemon, which shows it to the user
        _say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    outcome = events[-1] if events else None
    if outcome is None or outcome.outcome != "cold":
        reason = outcome.reason if outcome else "nothing was loaded"
        _say({"ok": False, "error": f"the new version was not cached: {reason}"})
        return 1
    _say({"ok": True, "key": outcome.key, "seconds": outcome.seconds})
    return 0


def _say(result: RefreshResult) -> None:
    """The last line of the output, which the daemon's ``Refresher`` reads."""
    print(json.dumps(result))


if __name__ == "__main__":
    raise SystemExit(worker())
