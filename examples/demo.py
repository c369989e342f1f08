"""The overmind-lab demo (``make demo``): a kernel restart that costs almost nothing.

1. Builds, once, a Stable Diffusion 1.5 pipeline with the real architecture and random
   weights (``.models/``, offline: nothing is downloaded).
2. Runs the same load script in two fresh Python processes, the way a notebook runs a
   cell before and after a kernel restart::

       import overmind_lab; overmind_lab.patch_all()
       pipe = StableDiffusionPipeline.from_pretrained(path, dtype=torch.float16)

   The first process loads from disk and parks the pipeline in the daemon's shared
   memory; the second gets it back from there.
3. Prints the cold and warm times and the memory held, then how to open the example
   notebook in JupyterLab.

``python examples/demo.py --tiny`` does the same with a few-MB pipeline in seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# overmind_lab from the checkout where it is not installed; the model builders always from
# the checkout (benchmarks/, which the wheel does not ship)
if importlib.util.find_spec("overmind_lab") is None:
    sys.path.insert(0, str(HERE.parent))
else:
    sys.path.append(str(HERE.parent))
REPO = HERE.parent


def child(path: str, dtype: str) -> None:
    """One "kernel": import, patch, load the pipeline, report as one JSON line."""
    started = time.perf_counter()
    import torch
    from diffusers import StableDiffusionPipeline

    import overmind_lab

    overmind_lab.patch_all()
    imported = time.perf_counter()
    with overmind_lab.record_loads() as events:
        pipe = StableDiffusionPipeline.from_pretrained(path, dtype=getattr(torch, dtype))
    loaded = time.perf_counter()
    [event] = events
    print(json.dumps({
        "pid": os.getpid(),
        "outcome": event.outcome,
        "reason": event.reason,
        "import_seconds": imported - started,
        "load_seconds": loaded - imported,
        "cold_seconds": event.cold_seconds,
        "rss_bytes": _rss(),
        "parameters": sum(p.numel() for p in pipe.unet.parameters()),
    }))


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_child(path: Path, dtype: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(path),
         "--load-dtype", dtype],
        env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"the load script failed (exit {proc.returncode})")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def warm_kernel_note() -> str:
    """How the notebook's kernel restarts get their imports done too: the warm kernelspec
    (which the notebook asks for) if it is installed, else how to install it."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        from overmind_lab._jupyter_server.kernelspec import DEFAULT_NAME, DISPLAY_NAME

        installed = DEFAULT_NAME in KernelSpecManager().find_kernel_specs()
    except ImportError:
        return "Install jupyter_client and ipykernel to run the notebook."
    if installed:
        return (f"It runs in the warm kernel \"{DISPLAY_NAME}\" (installed): after a\n"
                f"restart the kernel is forked from a zygote that imported torch and diffusers\n"
                f"already, so the load cell right after a restart skips the imports too.")
    return (f"The notebook asks for the warm kernel \"{DISPLAY_NAME}\" (restarts with the\n"
            f"imports done); it is not installed, so Jupyter offers another Python 3 kernel.\n"
            f"Install it with: {sys.executable} -m overmind_lab kernel install --sys-prefix")


def forget(client: Any, path: Path) -> int:
    """Evict earlier entries of this model, so that the first run really is cold."""
    evicted = 0
    for entry in client.entries():
        source = entry.get("source") or ""
        if source == str(path) or source.startswith(str(path) + os.sep):
            evicted += len(client.evict(entry["key"]))
    return evicted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny pipeline (same classes, a few MB) instead of SD 1.5 size")
    parser.add_argument("--models", type=Path, default=REPO / ".models",
                        help="where the pipeline is built (default: %(default)s)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "float32"),
                        help="dtype the weights are stored in (default: %(default)s)")
    parser.add_argument("--load-dtype", default="float16", choices=("float16", "float32"),
                        help="dtype= passed to from_pretrained (default: %(default)s)")
    parser.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.load_dtype)
        return 0

    from benchmarks import models as _models
    from overmind_lab import Client
    from overmind_lab._common.display import (
        format_bytes,
        format_seconds,
        format_speedup,
        text_table,
    )

    name = f"sd15{'-tiny' if args.tiny else ''}-{args.dtype}"
    print(f"[1/3] building the pipeline (once): {args.models / name}", flush=True)
    t0 = time.perf_counter()
    path = _models.build_sd15_pipeline(args.models / name, dtype=args.dtype, tiny=args.tiny)
    print(f"      ready in {format_seconds(time.perf_counter() - t0)}")

    client = Client()
    status = client.start()
    evicted = forget(client, path)
    print(f"[2/3] daemon pid {status['pid']} on {status['socket']}"
          + (f" (evicted {evicted} earlier entries of this model)" if evicted else ""))

    runs = []
    for label in ("first kernel", "after a restart"):
        print(f"      {label}: a fresh process loads the pipeline ...", flush=True)
        result = run_child(path, args.load_dtype)
        result["label"] = label
        result["cached_bytes"] = client.status()["cached_bytes"]
        runs.append(result)

    plain = runs[0]["cold_seconds"]  # the original from_pretrained inside the cold run
    rows = [
        (r["label"], r["outcome"], format_seconds(r["import_seconds"]),
         format_seconds(r["load_seconds"]),
         "-" if r is runs[0] else format_speedup(plain, r["load_seconds"]) + " faster",
         format_bytes(r["rss_bytes"]), format_bytes(r["cached_bytes"]))
        for r in runs
    ]
    params = runs[0]["parameters"] / 1e6
    print(f"\n[3/3] StableDiffusionPipeline.from_pretrained, UNet {params:.1f}M parameters, "
          f"stored {args.dtype}, loaded as {args.load_dtype}\n")
    print(text_table(("process", "load", "imports", "from_pretrained", "vs plain load",
                      "process RSS", "daemon holds"), rows, right=(2, 3, 4, 5, 6)))
    if plain is not None:
        print(f"\nThe cold run is the plain load ({format_seconds(plain)}) plus parking the "
              f"result in the cache ({format_seconds(runs[0]['load_seconds'] - plain)}).")
    print("Process RSS counts the cache pages a process has touched so far; the daemon\n"
          "holds them once for every process.")
    for r in runs:
        if r["outcome"] not in ("cold", "warm"):
            print(f"\nnote: {r['label']} was {r['outcome']}: {r['reason']}")
    as_root = " --allow-root" if os.geteuid() == 0 else ""  # jupyter refuses root without it
    print(f"""
The second process got the pipeline from the daemon's shared memory: its tensors map
the same pages the daemon holds, without copying them. Imports are the part a restart
still pays.

Next, the notebook (cold vs warm with %timeit, a kernel restart, the cache panel):

    {sys.executable} -m jupyter lab{as_root} {HERE / 'cold_vs_warm.ipynb'}

{warm_kernel_note()}

The daemon keeps the pipeline until it is evicted or stopped: the notebook's first load
of {path} is warm already.
Stop it with: {sys.executable} -m overmind_lab stop""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
