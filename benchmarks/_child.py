"""The benchmark's measuring process: ``python -m benchmarks._child JOB_JSON``.

One fresh process per measurement. It speaks JSON lines with the parent on a private
copy of its original stdout (library output is sent to stderr, which the parent keeps in
a log file):

1. imports (timed): for cached modes the ``overmind_lab`` package, then torch, the loading
   library and class; then ``{"event": "ready", ...}``;
2. waits for ``go`` on stdin (so the parent can let it import while nothing is being
   timed, and run the measurements one at a time);
3. times the load call alone (``plain``: the library's own ``from_pretrained``, or the
   job's ``method``, e.g. ``from_single_file``, with its ``kwargs``;
   ``first``/``warm``: ``overmind_lab.load(Cls.from_pretrained, ...)``, ``overmind_lab``
   imported first and nothing else of it: the first call pays what its start-up thread has
   not done, as a user's does),
   then, untimed
   for the ratios, the first touch of every weight page, optionally a correctness check
   against a plain load, and reports ``{"event": "result", ...}``;
4. with ``hold``: sums every weight (all pages touched), reports ``holding`` and waits
   for ``exit`` so the parent can read its PSS while the others are alive.

Modes: ``plain``, ``first``, ``warm`` (``first`` and ``warm`` are the same call; the
parent evicts before ``first``), ``idle`` (imports only: the runtime's memory).
The parent never imports torch; only these processes do.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

_proto: Any = None


def _send(event: str, **fields: Any) -> None:
    _proto.write(json.dumps({"event": event, **fields}, default=str) + "\n")
    _proto.flush()


def _wait_for(word: str) -> None:
    line = sys.stdin.readline()
    if not line:  # the parent went away
        os._exit(3)
    if line.strip() != word:
        raise RuntimeError(f"expected {word!r} from the parent, got {line.strip()!r}")


def _setup_streams() -> None:
    """Keep the original stdout for the protocol; everything else prints to stderr."""
    global _proto
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _proto = os.fdopen(proto_fd, "w", buffering=1, encoding="utf-8")


def _quiet_libraries() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*torchvision.*")


def _import_loader(loader: str) -> Any:
    module_name, _, attr = loader.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _tensors(obj: Any) -> list[Any]:
    """Every tensor an object holds (modules' state dicts, a pipeline's components)."""
    import torch

    out: list[Any] = []
    if isinstance(obj, torch.nn.Module):
        out.extend(obj.state_dict().values())
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif hasattr(obj, "components") and isinstance(obj.components, dict):
        for value in obj.components.values():
            out.extend(_tensors(value))
    elif isinstance(obj, dict):
        for value in obj.values():
            out.extend(_tensors(value))
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            out.extend(_tensors(value))
    return out


def _unique_storages(tensors: list[Any]) -> list[Any]:
    seen: set[tuple[int, int]] = set()
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        ident = (storage.data_ptr(), storage.nbytes())
        if ident in seen or storage.nbytes() == 0:
            continue
        seen.add(ident)
        out.append(storage)
    return out


def _storage_bytes(storages: list[Any]) -> int:
    return sum(int(s.nbytes()) for s in storages)


def _touch_pages(storages: list[Any]) -> None:
    """Read one byte of every 4 KiB page of every storage (faults each page in once)."""
    import torch

    for storage in storages:
        view = torch.empty(0, dtype=torch.uint8).set_(storage)
        view[::4096].sum()


def _sum_all(tensors: list[Any]) -> float:
    """Sum every element of every tensor (reads every byte; no full-size temporaries)."""
    import torch

    total = 0.0
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point():
                total += float(t.sum(dtype=torch.float32))
            elif t.numel():
                total += float(t.sum())
    return total


def _pss_self() -> dict[str, int]:
    from benchmarks._memory import read_smaps_rollup

    return read_smaps_rollup(os.getpid())


def _main(job: dict[str, Any]) -> None:
    _setup_streams()
    _quiet_libraries()
    mode = job["mode"]
    cached = mode in ("first", "warm", "restart", "reboot")

    t0 = time.perf_counter()
    if cached or job.get("import_overmind", False):
        # Only the package, first, as a user's ``import overmind_lab`` or ``%load_ext`` above the
        # other imports: its thread does the first load's imports and scans meanwhile (Note [The
        # first call's work, earlier]); what it has not done when the load starts, the load pays.
        import overmind_lab
    t_om = time.perf_counter()
    import torch

    t_torch = time.perf_counter()
    cls = _import_loader(job["loader"])
    for module in job.get("imports", ()):
        importlib.import_module(module)
    t_lib = time.perf_counter()
    _send(
        "ready",
        pid=os.getpid(),
        import_seconds=t_lib - t0,
        import_torch_seconds=t_torch - t_om,
        import_library_seconds=t_lib - t_torch,
        import_overmind_seconds=t_om - t0,
        torch_version=torch.__version__,
        threads=torch.get_num_threads(),
    )
    _wait_for("go")

    if mode == "idle":
        _send("holding", pid=os.getpid(), pss=_pss_self())
        _wait_for("exit")
        _send("result", pid=os.getpid())
        return

    dtype = getattr(torch, job["dtype"])
    kwargs = {"dtype": dtype, **job.get("kwargs", {})}
    method = getattr(cls, job.get("method", "from_pretrained"))
    outcome = "plain"
    event: dict[str, Any] = {}
    repeat_seconds: float | None = None
    if cached:
        start = time.perf_counter()
        started = time.monotonic()
        with overmind_lab.record_loads() as events:
            obj = overmind_lab.load(method, job["path"], **kwargs)
        load_seconds = time.perf_counter() - start
        if mode == "warm":
            # The same call again at once, the first object alive: what the first call paid on
            # top is overmind-lab's per-process start-up.
            start = time.perf_counter()
            again = overmind_lab.load(method, job["path"], **kwargs)
            repeat_seconds = time.perf_counter() - start
            del again
        if events:
            ev = events[-1]
            outcome = ev.outcome
            event = {"outcome": ev.outcome, "seconds": ev.seconds, "cold_seconds": ev.cold_seconds,
                     "reason": ev.reason, "key": ev.key}
        else:
            outcome = "unknown"
    else:
        start = time.perf_counter()
        obj = method(job["path"], **kwargs)
        load_seconds = time.perf_counter() - start

    tensors = _tensors(obj)
    storages = _unique_storages(tensors)
    start = time.perf_counter()
    _touch_pages(storages)
    touch_seconds = time.perf_counter() - start
    encode_seconds = _first_encoding(obj)

    result: dict[str, Any] = {
        "pid": os.getpid(),
        "load_seconds": load_seconds,
        "touch_seconds": touch_seconds,
        "outcome": outcome,
        "load_event": event,
        "type": f"{type(obj).__module__}.{type(obj).__qualname__}",
        "tensors": len(tensors),
        "storage_bytes": _storage_bytes(storages),
    }
    if repeat_seconds is not None:
        result["repeat_seconds"] = repeat_seconds
    if encode_seconds is not None:
        result["encode_seconds"] = encode_seconds
    if cached:
        result["cache_key"] = overmind_lab.key_of(obj)
        # A large first load is stored by a forked process after the call returned (Note
        # [Storing in a forked process]): report when it was stored, and wait for it, so
        # that the next process measures a warm load rather than a wait for this store.
        for store in overmind_lab.wait_for_stores(timeout=job.get("store_timeout", 900)):
            result["stored_seconds"] = (store.finished or started) - started
            if store.error is not None:
                result["store_error"] = store.error
    if job.get("check"):
        from benchmarks._compare import compare

        plain = method(job["path"], **kwargs)
        result["check"] = compare(obj, plain)
        del plain
    if job.get("hold"):
        start = time.perf_counter()
        checksum = _sum_all(tensors)
        result["sum_seconds"] = time.perf_counter() - start
        result["checksum"] = checksum
        _send("holding", **result)
        _wait_for("exit")
    _send("result", **result)


#: what a pipeline's first use encodes
PROMPT = "a photo of an astronaut riding a horse on mars"


def _first_encoding(obj: Any) -> float | None:
    """Seconds for the first encoding of a prompt by the result's tokenizer (a pipeline's, or the
    result itself), ``None`` if it has none. A warm hit builds its Rust tokenizer here (Note [A
    tokenizer built on first use]); a plain load built it inside the load."""
    tok = getattr(obj, "tokenizer", None) or obj
    if not (callable(tok) and callable(getattr(tok, "get_vocab", None))):
        return None
    start = time.perf_counter()
    tok(PROMPT)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(argv[0])
    try:
        _main(job)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit 1
        if _proto is not None:
            _send("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    _proto.flush()
    # skip interpreter teardown (unmapping gigabytes of tensors one by one): the parent
    # waits for this exit before it times the next process.
    os._exit(0)


if __name__ == "__main__":
    main()
