"""The measuring process of ``overmind-lab bench PATH`` (``python -m overmind_lab._measuring``):
imports once, then forks one child per measurement.

Note [One import, forked measurements]: a kernel after a restart pays the imports (torch, the
library, the model's class, overmind_lab: seconds) and then the load. Paying the imports again for
each of a dozen measurements made the bench take minutes on a 4 MiB model. So, as the zygote does
for kernels (``_zygote/loop.py``), this process imports what a fresh process imports before its
load, timing each import (the bench's import figures: one fresh process's), and then forks a
child for each measurement that loads, touches and reports. The child's load is the load a fresh
process makes after its imports: this process never loads, never touches a tensor and never
freezes its heap (``gc.freeze`` would make the child's collections cheaper than a fresh
process's); the child reseeds, takes a fresh process's BLAS thread counts and environment, and
exits without tearing its modules down. Every check that makes a fork safe (one thread, no CUDA,
no zmq) is the zygote's own (:func:`overmind_lab._zygote.loop.fork_refusal`).

The wire, one JSON object a line: the first line on stdin is the spec (``path``, ``library``,
``class``, ``dtype``, ``env``: the children's environment); the process answers on stdout
``{"ready": true, "imports": {...}}`` (or ``{"error": ...}``); each later line on stdin,
``{"cached": bool}``, is answered by one child's result ``{"load", "touch", "outcome",
"pid"}`` (or ``{"error": ...}``). End of stdin ends the process. Anything the libraries print
goes to stderr, never into the answers.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from typing import Any, BinaryIO

__all__ = ["main"]

#: Set for this process only, restored in the children: with one thread OpenBLAS starts no pool
#: at import, and torch checks CUDA without initializing it (as ``zygote_client.spawn`` does).
PARENT_ONLY_ENV = {"OPENBLAS_NUM_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def _send(out: BinaryIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def _import(spec: dict[str, Any]) -> tuple[Any, dict[str, float]]:
    """What a fresh process imports before its load, each part timed."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    import torch  # noqa: F401 - the import is what is timed

    t1 = time.perf_counter()
    times["torch"] = t1 - t0
    module = importlib.import_module(spec["library"])
    cls = getattr(module, spec["class"])
    t2 = time.perf_counter()
    times[spec["library"]] = t2 - t1
    import overmind_lab
    from overmind_lab._loading import keys

    for name in ("load", "record_loads", "wait_for_stores"):
        getattr(overmind_lab, name)
    keys.prewarm()  # what the thread that ``import overmind_lab`` starts does in a fresh process
    times["overmind_lab"] = time.perf_counter() - t2
    return cls, times


def _touch(obj: Any) -> None:
    """Read every parameter and buffer once: what the first forward pays to fault pages in."""
    import torch

    with torch.no_grad():
        for part in [obj, *getattr(obj, "components", {}).values()]:
            if isinstance(part, torch.nn.Module):
                for t in [*part.parameters(), *part.buffers()]:
                    t.sum()


def _measure(cls: Any, spec: dict[str, Any], cached: bool) -> dict[str, Any]:
    """In the child: one load, plain or through the cache, and its first touch."""
    import torch

    import overmind_lab

    kwargs = {"dtype": getattr(torch, spec["dtype"])} if spec["dtype"] else {}
    t0 = time.perf_counter()
    if cached:
        with overmind_lab.record_loads() as events:
            obj = overmind_lab.load(cls.from_pretrained, spec["path"], **kwargs)
        outcome = events[0].outcome if events else "?"
    else:
        obj, outcome = cls.from_pretrained(spec["path"], **kwargs), "plain"
    t1 = time.perf_counter()
    _touch(obj)
    t2 = time.perf_counter()
    if cached:
        overmind_lab.wait_for_stores()  # the next measurement must find the entry stored
    return {"load": t1 - t0, "touch": t2 - t1, "outcome": outcome, "pid": os.getpid()}


def _child(cls: Any, spec: dict[str, Any], cached: bool, result_fd: int,
           targets: dict[str, int]) -> None:
    """Right after the fork: become a fresh process after its imports, measure, exit here
    (Note [Leaving the zygote's loop] in ``_forked/become.py``)."""
    from overmind_lab._common.exiting import exit_now
    from overmind_lab._forked import become

    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        become._replace_environ(spec["env"], {})
        become._reseed()
        become._fresh_library_state()
        become._set_threads(targets)
        result = _measure(cls, spec, cached)
        os.write(result_fd, json.dumps(result).encode())
        code = 0
    except BaseException:  # noqa: BLE001 - the top of this process: report, then exit
        traceback.print_exc()
    exit_now(code)


def _fork_and_measure(cls: Any, spec: dict[str, Any], cached: bool, answers: BinaryIO,
                      targets: dict[str, int]) -> dict[str, Any]:
    from overmind_lab._zygote.loop import fork_refusal

    refusal = fork_refusal()
    if refusal:
        return {"error": f"cannot fork a measuring process: {refusal}"}
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        os.close(answers.fileno())
        _child(cls, spec, cached, write_fd, targets)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if not data:
        return {"error": f"the measuring process {pid} failed (exit status "
                         f"{os.waitstatus_to_exitcode(status)})"}
    return dict(json.loads(data))


def _thread_targets(probe: Any) -> dict[str, int]:
    try:
        out, _ = probe.communicate(timeout=60)
        return {str(k): int(v) for k, v in json.loads(out or "{}").items()}
    except (ValueError, OSError, TypeError):
        probe.kill()
        probe.wait()
        return {}


def main() -> int:
    # the answers get this process's stdout; what anything else prints goes to stderr
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    spec = json.loads(sys.stdin.readline())
    from overmind_lab._forked import become
    from overmind_lab._zygote.loop import _probe_threads, _stop_library_threads

    # Note [BLAS threads] in ``_zygote/loop.py``: the counts a fresh process gets, probed by a
    # fresh interpreter while this one imports (as the zygote does)
    probe = _probe_threads(spec["env"])
    try:
        cls, imports = _import(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the bench, which names it
        probe.kill()
        probe.wait()
        _send(answers, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    try:  # after the timed imports: how the children set their BLAS thread counts
        import threadpoolctl  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        pass  # no probe result either: the probe imports it too
    _stop_library_threads()
    targets = _thread_targets(probe)
    become.prepare_in_zygote()
    _send(answers, {"ready": True, "imports": imports})
    for line in sys.stdin:
        request = json.loads(line)
        _send(answers, _fork_and_measure(cls, spec, bool(request["cached"]), answers, targets))
    return 0


if __name__ == "__main__":
    from overmind_lab._common.exiting import exit_now

    exit_now(main())  # Note [Fast exit]: no teardown of the imported modules
