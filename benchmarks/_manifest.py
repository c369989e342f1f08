"""What the dependency manifest costs (Note [What a load depends on]): ``python -m
benchmarks._manifest``.

Two models: the SD 1.5 pipeline (fp16, from ``--models-dir``, built there if missing; ``--tiny``:
the tiny pipeline in a temporary folder, the same classes, modules and files) and a user model
split over three files (a module with the class, one with a layer factory, one with a constant).
On a private daemon, each measurement in a fresh process, side by side in one run:

- the cold load as the user waits for it, watched (the audit hook, the registries' snapshot, the
  manifest built at the store, ``faithful.check``) and unwatched (``Recorder``, ``Watch``,
  ``build`` and ``check`` replaced by no-ops in that process: the code as it was before them),
  interleaved, the entry evicted before each;
- a warm hit: the whole first call in a fresh process and the same call repeated, and inside each
  the time of the checks a hit makes before rebuilding (``manifest.changed``, the classes'
  ``user_code.changed``) and of the registrations' replay (``effects.replay``);
- the manifest itself: what it lists and its size in the entry.

Prints a table and writes ``manifest.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from benchmarks import DEFAULT_MODELS_DIR
from benchmarks._service import PrivateDaemon

REPO = Path(__file__).resolve().parent.parent

SPLIT = {
    "bm_helpers.py": "WIDTH = 256\nDEPTH = 8\n",
    "bm_layers.py": """
        import torch
        from bm_helpers import WIDTH


        def make_layer():
            layer = torch.nn.Linear(WIDTH, WIDTH, device="meta").to_empty(device="cpu")
            with torch.no_grad():
                layer.weight.fill_(0.5)
                layer.bias.zero_()
            return layer
    """,
    "bm_net.py": """
        import torch
        from bm_helpers import DEPTH
        from bm_layers import make_layer


        class Net(torch.nn.Module):
            def __init__(self, path):
                super().__init__()
                self.blocks = torch.nn.ModuleList(make_layer() for _ in range(DEPTH))
    """,
}

CHILD = """
import json, sys, time
job = json.loads(sys.argv[1])
sys.path.insert(0, job["folder"])
import overmind_lab
from overmind_lab._loading import effects, load as _load, manifest, user_code
spent = {"manifest": [], "code": [], "effects": []}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name].append(time.perf_counter() - t0)
    return wrapper


manifest.changed = timed("manifest", manifest.changed)
user_code.changed = timed("code", user_code.changed)
effects.replay = timed("effects", effects.replay)
if not job["watched"]:  # the code before the manifest: nothing observed, nothing built
    class Idle:
        registered = []
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return None
        def record(self, classes):
            return {}
    manifest.Recorder = Idle
    effects.Watch = Idle
    manifest.build = lambda *args, **kwargs: {}
    from overmind_lab._loading import faithful
    faithful.check = lambda *args, **kwargs: None
if job["kind"] == "pipeline":
    import torch
    from diffusers import StableDiffusionPipeline as loader_class
    fn, kwargs = loader_class.from_pretrained, {"dtype": torch.float16}
else:
    from bm_net import Net
    fn, kwargs = Net, {}
times, outcomes = [], []
for _ in range(job["calls"]):
    t0 = time.perf_counter()
    with overmind_lab.record_loads() as events:
        obj = overmind_lab.load(fn, job["path"], **kwargs)
    times.append(time.perf_counter() - t0)
    outcomes.append(events[-1].outcome)
    del obj
overmind_lab.wait_for_stores(timeout=900)
print(json.dumps({"times": times, "outcomes": outcomes, "spent": spent}))
"""


def _child(job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], capture_output=True,
                          text=True, env=env, timeout=1800, cwd=job["folder"])
    if proc.returncode != 0:
        raise RuntimeError(f"child failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _entry_meta(daemon: PrivateDaemon) -> dict[str, Any]:
    from overmind_lab._loading.client import Client

    [entry] = daemon.client().entries()
    session = Client(daemon.socket).session()
    with session:
        found, fds = session.lookup(entry["key"], refresh=False)
    for fd in fds:
        os.close(fd)
    return dict(found["meta"]) if found else {}


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 3)


def _case(kind: str, path: str, folder: str, daemon: PrivateDaemon, env: dict[str, str],
          repeat: int) -> dict[str, Any]:
    print(f"{kind}: {path}", file=sys.stderr)
    cold: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeat):
        for watched in ((True, False) if i % 2 == 0 else (False, True)):
            daemon.evict_all()
            out = _child({"kind": kind, "path": path, "folder": folder, "watched": watched,
                          "calls": 1}, env)
            assert out["outcomes"] == ["cold"], out
            cold[watched].append(out["times"][0])
    daemon.evict_all()
    _child({"kind": kind, "path": path, "folder": folder, "watched": True, "calls": 1}, env)
    meta = _entry_meta(daemon)
    first, repeated, checks_first, checks_repeated = [], [], [], []
    for _ in range(repeat):
        out = _child({"kind": kind, "path": path, "folder": folder, "watched": True,
                      "calls": 4}, env)
        assert out["outcomes"] == ["warm"] * 4, out
        first.append(out["times"][0])
        repeated.append(statistics.median(out["times"][1:]))
        spent = out["spent"]
        checks = [m + c + e for m, c, e in zip(spent["manifest"], spent["code"], spent["effects"],
                                                strict=True)]
        checks_first.append(checks[0])
        checks_repeated.append(statistics.median(checks[1:]))
    deps = meta.get("deps", {})
    return {
        "cold_watched_ms": _median_ms(cold[True]), "cold_unwatched_ms": _median_ms(cold[False]),
        "cold_ratio": round(statistics.median(cold[True]) / statistics.median(cold[False]), 3),
        "warm_first_ms": _median_ms(first), "warm_repeated_ms": _median_ms(repeated),
        "check_first_ms": _median_ms(checks_first),
        "check_repeated_ms": _median_ms(checks_repeated),
        "manifest": {kind_: len(items) for kind_, items in deps.items()},
        "manifest_bytes": len(json.dumps(deps)),
        "manifest_lists": {kind_: [item[0] for item in items] for kind_, items in deps.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._manifest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", default=DEFAULT_MODELS_DIR)
    parser.add_argument("--tiny", action="store_true", help="the tiny SD 1.5 pipeline")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args(argv)
    import torch

    from benchmarks import models

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-manifest-") as tmp:
        if args.tiny:
            pipeline = models.build_sd15_pipeline(Path(tmp) / "sd15", dtype=torch.float16,
                                                  tiny=True)
        else:
            pipeline = models.build_sd15_pipeline(
                Path(args.models_dir).expanduser() / "sd15-fp16", dtype=torch.float16)
        for name, text in SPLIT.items():
            (Path(tmp) / name).write_text(textwrap.dedent(text))
        with PrivateDaemon(None, out_dir / "manifest-daemon.log") as daemon:
            env = {**os.environ, "OVERMIND_LAB_SOCKET": daemon.socket,
                   "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
            if daemon.cache_dir:
                env["OVERMIND_LAB_CACHE_DIR"] = daemon.cache_dir
            started = time.time()
            results = {
                "pipeline": _case("pipeline", str(pipeline), tmp, daemon, env, args.repeat),
                "split": _case("split", "unused", tmp, daemon, env, args.repeat),
                "repeat": args.repeat, "tiny": args.tiny,
                "seconds": round(time.time() - started, 1),
            }
    (out_dir / "manifest.json").write_text(json.dumps(results, indent=2) + "\n")
    print("| model | cold watched / unwatched (ms) | ratio | warm first / repeated (ms) | "
          "checks first / repeated (ms) | manifest |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in ("pipeline", "split"):
        r = results[name]
        print(f"| {name} | {r['cold_watched_ms']} / {r['cold_unwatched_ms']} | "
              f"{r['cold_ratio']}x | {r['warm_first_ms']} / {r['warm_repeated_ms']} | "
              f"{r['check_first_ms']} / {r['check_repeated_ms']} | {r['manifest']}, "
              f"{r['manifest_bytes']} bytes |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
