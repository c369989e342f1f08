"""The kernel-restart loop (load time after a restart): a real ipykernel driven through ``jupyter_client``.

One kernel runs the pipeline load cell three times, restarted in between:

1. ``plain``: the cell without overmind-lab (what a restart costs today);
2. ``cold``: with ``%load_ext overmind_lab`` + ``%overmind_load``, cache evicted first
   (the first run stores the pipeline);
3. ``warm``: the same cell after a kernel restart (served from the cache).

Each cell's wall time (as the notebook user waits for it, imports included) and the time
of its load statement alone are reported. When the IPython extension cannot be loaded,
the case is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_kernel_restart"]

_MARK = "OVERMIND_BENCH_RESULT "

_PLAIN_CELL = """\
import time, json
import torch
from diffusers import StableDiffusionPipeline
_t = time.perf_counter()
pipe = StableDiffusionPipeline.from_pretrained({path!r}, dtype=torch.{dtype})
_load_seconds = time.perf_counter() - _t
"""

_CACHED_CELL = """\
%load_ext overmind_lab
%overmind_load
import time, json
import torch
from diffusers import StableDiffusionPipeline
_t = time.perf_counter()
pipe = StableDiffusionPipeline.from_pretrained({path!r}, dtype=torch.{dtype})
_load_seconds = time.perf_counter() - _t
"""

_REPORT_CELL = """\
import json as _json, sys as _sys
_key = None
if "overmind_lab" in _sys.modules:
    import overmind_lab as _om
    _key = _om.key_of(pipe)
print({mark!r} + _json.dumps({{"load_seconds": _load_seconds, "type": type(pipe).__name__,
                              "cache_key": _key, "unet_dtype": str(pipe.unet.dtype)}}))
"""

_PROBE_CELL = """\
%load_ext overmind_lab
assert get_ipython().find_line_magic("overmind_load") is not None, "no %overmind_load magic"
"""


class _Skip(Exception):
    pass


def _kernel_spec_dir(root: Path) -> Path:
    spec_dir = root / "kernels" / "overmind-bench"
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "overmind-lab bench (this Python)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    return root / "kernels"


def _run_cell(kc: Any, code: str, timeout: float) -> dict[str, Any]:
    outputs: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        kind = msg.get("msg_type")
        content = msg.get("content", {})
        if kind == "stream":
            outputs.append(content.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            outputs.append(content.get("data", {}).get("text/plain", ""))
        elif kind == "error":
            outputs.append(f"{content.get('ename')}: {content.get('evalue')}")

    start = time.perf_counter()
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook, store_history=True)
    seconds = time.perf_counter() - start
    content = reply.get("content", {})
    text = "".join(outputs)
    result: dict[str, Any] = {"cell_seconds": seconds, "status": content.get("status"), "output": text[-1500:]}
    if content.get("status") != "ok":
        result["error"] = f"{content.get('ename')}: {content.get('evalue')}"
    for line in text.splitlines():
        if line.startswith(_MARK):
            with contextlib.suppress(ValueError):
                result["report"] = json.loads(line[len(_MARK):])
    return result


def run_kernel_restart(
    path: Path,
    dtype: str,
    env: dict[str, str],
    evict_all: Callable[[], Any],
    entries: Callable[[], list[dict[str, Any]]],
    progress: Callable[[str], None],
    timeout: float = 600.0,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """Run the plain / cold / warm cells in one restarted kernel; JSON-ready result."""
    result: dict[str, Any] = {"path": str(path), "dtype": dtype, "skipped": False}
    try:
        import ipykernel  # noqa: F401
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import KernelManager
    except ImportError as exc:
        return {**result, "skipped": True, "note": f"jupyter_client/ipykernel not available: {exc}"}

    tmp = tempfile.mkdtemp(prefix="overmind-bench-kernel-")
    ksm = KernelSpecManager(kernel_dirs=[str(_kernel_spec_dir(Path(tmp)))])
    km = KernelManager(kernel_name="overmind-bench", kernel_spec_manager=ksm)
    kc = None
    log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - closed below
    kernel_env = dict(env)
    kernel_env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

    def fresh(reason: str) -> float:
        nonlocal kc
        start = time.perf_counter()
        if kc is None:
            if log is not None:
                km.start_kernel(env=kernel_env, stdout=log, stderr=log)
            else:
                km.start_kernel(env=kernel_env)
            kc = km.client()
            kc.start_channels()
        else:
            km.restart_kernel(now=True, env=kernel_env)
        kc.wait_for_ready(timeout=timeout)
        seconds = time.perf_counter() - start
        progress(f"kernel {reason} in {seconds:.1f} s")
        return seconds

    def cell(name: str, code: str) -> dict[str, Any]:
        assert kc is not None
        res = _run_cell(kc, code.format(path=str(path), dtype=dtype), timeout)
        if res["status"] != "ok":
            return res
        report = _run_cell(kc, _REPORT_CELL.format(mark=_MARK), timeout)
        res.update(report.get("report", {}))
        return res

    try:
        result["kernel_start_seconds"] = fresh("started")
        progress("kernel: plain load cell (no overmind-lab)")
        result["plain"] = cell("plain", _PLAIN_CELL)
        if result["plain"]["status"] != "ok":
            raise RuntimeError(f"the plain cell failed: {result['plain'].get('error')}")
        probe = _run_cell(kc, _PROBE_CELL, timeout)
        if probe["status"] != "ok":
            raise _Skip(f"the IPython extension could not be loaded ({probe.get('error')}); "
                        "the kernel-restart case needs `%load_ext overmind_lab` and `%overmind_load`")
        result["restart_seconds"] = fresh("restarted")
        evict_all()
        progress("kernel: cold load cell (%overmind_load, cache empty)")
        result["cold"] = cell("cold", _CACHED_CELL)
        if result["cold"]["status"] != "ok":
            raise RuntimeError(f"the cached cell failed: {result['cold'].get('error')}")
        result["restart_seconds_2"] = fresh("restarted")
        hits_before = sum(int(e.get("hits") or 0) for e in entries()
                          if "StableDiffusionPipeline" in str(e.get("name", "")))
        progress("kernel: warm load cell after the restart")
        result["warm"] = cell("warm", _CACHED_CELL)
        if result["warm"]["status"] != "ok":
            raise RuntimeError(f"the warm cell failed: {result['warm'].get('error')}")
        hits = [e for e in entries() if "StableDiffusionPipeline" in str(e.get("name", ""))]
        result["entry"] = ({k: hits[0].get(k) for k in ("name", "bytes", "hits", "cold_seconds",
                                                         "warm_seconds", "tensors")}
                           if hits else None)
        plain, cold, warm = (result[k] for k in ("plain", "cold", "warm"))
        result["ratios"] = {
            "warm_cell_over_plain_cell": warm["cell_seconds"] / plain["cell_seconds"],
            "warm_load_over_plain_load": (warm.get("load_seconds", float("nan"))
                                          / plain.get("load_seconds", float("nan"))),
            "cold_cell_over_plain_cell": cold["cell_seconds"] / plain["cell_seconds"],
        }
        hits_after = sum(int(e.get("hits") or 0) for e in hits)
        # proof by the daemon's counter, not by timing: the warm cell was a cache hit
        result["warm_from_cache"] = bool(warm.get("cache_key")) and hits_after > hits_before
    except _Skip as exc:
        result.update(skipped=True, note=str(exc))
    except Exception as exc:  # noqa: BLE001 - reported, never fatal for the benchmark
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if kc is not None:
            with contextlib.suppress(Exception):
                kc.stop_channels()
        with contextlib.suppress(Exception):
            km.shutdown_kernel(now=True)
        if log is not None:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return result
