"""``overmind-lab bench PATH``: how long your own model takes to load, plain and cached.

::

    overmind-lab bench ./my-unet                       # class from the folder's files
    overmind-lab bench ./sd15 --dtype float16 --repeat 5
    overmind-lab bench ./llm --class AutoModelForCausalLM

PATH: a folder ``save_pretrained`` wrote (diffusers or transformers model, pipeline or
tokenizer). Each row is measured in new Python processes, as a kernel after a
restart meets it: a plain ``from_pretrained``, the first load through the cache (cold),
a warm load, and a warm load after the daemon restarted; for each the load call, the first
touch of every parameter and buffer (what the first forward pays to fault pages in), and,
apart, the imports. A private daemon and cache (temporary socket and folder) serve the
measurement and are stopped and removed at the end: the user's own cache is untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from overmind_lab._common.display import format_seconds, text_table
from overmind_lab._common.naming import CACHE_DIR_ENV, SOCKET_ENV, default_cache_dir
from overmind_lab._errors import OvermindError

__all__ = ["add_parser", "detect", "run"]

#: One measurement, in a new process: imports, the load call, the first touch.
CHILD = r"""
import importlib, json, sys, time
t0 = time.perf_counter()
spec = json.loads(sys.argv[1])
import torch
for name in [spec["library"]] if spec["library"] else ["transformers", "diffusers"]:
    lib = importlib.import_module(name)
    cls = getattr(lib, spec["class"], None) or getattr(lib, spec["fallback"], None)
    if cls is not None:
        break
else:
    sys.exit(f"no class {spec['class']} in transformers or diffusers")
if spec["cached"]:
    import overmind_lab
t1 = time.perf_counter()
kwargs = {"dtype": getattr(torch, spec["dtype"])} if spec["dtype"] else {}
if spec["cached"]:
    with overmind_lab.record_loads() as events:
        obj = overmind_lab.load(cls.from_pretrained, spec["path"], **kwargs)
    outcome = events[0].outcome
else:
    obj, outcome = cls.from_pretrained(spec["path"], **kwargs), "plain"
t2 = time.perf_counter()
with torch.no_grad():
    for part in [obj, *getattr(obj, "components", {}).values()]:
        if isinstance(part, torch.nn.Module):
            for t in [*part.parameters(), *part.buffers()]:
                t.sum()
t3 = time.perf_counter()
if spec["cached"]:
    overmind_lab.wait_for_stores()  # the next row must find the entry stored
print(json.dumps({"imports": t1 - t0, "load": t2 - t1, "touch": t3 - t2, "outcome": outcome}))
"""

ROWS = (("plain", "plain from_pretrained"), ("cold", "first load, cached (cold)"),
        ("warm", "warm load"), ("restart", "warm load after a daemon restart"))


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def detect(path: Path, name: str | None = None) -> tuple[str | None, str, str]:
    """``(library, class, fallback class)`` to load ``path`` with; ``library`` is
    ``"diffusers"``, ``"transformers"`` or ``None`` (either, transformers first)."""
    if not path.is_dir():
        raise OvermindError(f"{path} is not a directory: give the folder save_pretrained wrote")
    config = _json(path / "config.json")
    library = ("diffusers" if (path / "model_index.json").is_file() or "_class_name" in config
               else "transformers" if config or (path / "tokenizer_config.json").is_file()
               else None)
    if name:
        module, _, short = name.rpartition(".")
        return module or library, short, short
    if library == "diffusers":  # a pipeline (model_index.json), or one model's class
        found = str(config.get("_class_name") or "DiffusionPipeline")
        return library, found, found
    if config.get("architectures") or config.get("model_type"):
        return "transformers", str((config.get("architectures") or ["AutoModel"])[0]), "AutoModel"
    if library == "transformers":
        return "transformers", "AutoTokenizer", "AutoTokenizer"
    raise OvermindError(f"cannot tell what {path} holds (no model_index.json, config.json or "
                        "tokenizer_config.json): name the class, e.g. --class "
                        "UNet2DConditionModel or --class AutoModel")


def _once(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise OvermindError(f"the measuring process failed (exit {proc.returncode}):\n"
                            f"{proc.stderr.strip()[-3000:]}")
    return dict(json.loads(lines[-1]))


def _row(label: str, runs: list[dict[str, Any]]) -> list[str]:
    med = {k: statistics.median(r[k] for r in runs) for k in ("load", "touch", "imports")}
    return [label, format_seconds(med["load"]), format_seconds(med["touch"]),
            format_seconds(med["load"] + med["touch"]), format_seconds(med["imports"]),
            ",".join(sorted({r["outcome"] for r in runs}))]


def run(args: argparse.Namespace) -> int:
    """Measure, print the table; the private daemon is stopped whatever happens."""
    from overmind_lab._extras import require
    from overmind_lab._loading.client import Client

    path = Path(args.path).expanduser().resolve()
    if not path.exists():
        raise OvermindError(f"{args.path} does not exist: give the folder save_pretrained wrote")
    library, name, fallback = detect(path, args.cls)
    require(library or "torch", "overmind-lab bench")
    if args.repeat < 1:
        raise OvermindError("--repeat must be at least 1")
    for f in path.rglob("*"):  # every row starts with the files in the page cache
        if f.is_file():
            with f.open("rb") as fh:
                while fh.read(1 << 24):
                    pass
    cache_parent = default_cache_dir().parent
    cache_parent.mkdir(parents=True, exist_ok=True)  # the user's file system, its tier
    cache = Path(tempfile.mkdtemp(prefix="overmind-lab-bench-", dir=cache_parent))
    run_dir = Path(tempfile.mkdtemp(prefix="overmind-lab-bench-"))
    socket = run_dir / "daemon.sock"
    saved = dict(os.environ)
    os.environ.update({SOCKET_ENV: str(socket), CACHE_DIR_ENV: str(cache / "cache")})
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TRANSFORMERS_VERBOSITY="error", DIFFUSERS_VERBOSITY="error")
    client = Client(socket)
    spec = {"path": str(path), "library": library, "class": name, "fallback": fallback,
            "dtype": args.dtype}
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key, _ in ROWS}
    try:
        print(f"overmind-lab bench: {name} ({library or 'transformers or diffusers'}) from "
              f"{path}, dtype {args.dtype or 'the default'}; private daemon on {socket}",
              flush=True)
        for _ in range(args.repeat):
            runs["plain"].append(_once({**spec, "cached": False}, env))
        client.start()
        for _ in range(args.repeat):
            client.evict_all()
            runs["cold"].append(_once({**spec, "cached": True}, env))
        for _ in range(args.repeat):
            runs["warm"].append(_once({**spec, "cached": True}, env))
        for _ in range(args.repeat):
            client.stop()
            client.start()
            runs["restart"].append(_once({**spec, "cached": True}, env))
    finally:
        client.stop()
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    print(text_table(["", "load", "first touch", "load + touch", "imports", "outcome"],
                     [_row(label, runs[key]) for key, label in ROWS], right=(1, 2, 3, 4)))
    print(textwrap.fill(
        f"Each row: {args.repeat} new process{'es' if args.repeat > 1 else ''} (median). load: "
        "the from_pretrained call alone; first touch: summing every parameter and buffer "
        "after it (what the first forward pays to fault pages in); imports (torch, the "
        "library, overmind_lab in the cached rows) are timed apart, not in load.", 92))
    return 0


def add_parser(subparsers: Any) -> None:
    """Register ``bench`` on the CLI's subparsers."""
    text = ("measure how long a model folder takes to load: plain, first and warm through "
            "the cache, after a daemon restart; each in new processes, on a private daemon")
    p = subparsers.add_parser("bench", help=text, description=text)
    p.add_argument("path", help="a folder save_pretrained wrote (diffusers or transformers "
                                "model, pipeline or tokenizer)")
    p.add_argument("--class", dest="cls", metavar="NAME",
                   help="the class to load with, e.g. UNet2DConditionModel, "
                        "StableDiffusionPipeline, AutoModel (default: from the folder's files)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="dtype= passed to from_pretrained (default: the library's)")
    p.add_argument("--repeat", type=int, default=3,
                   help="new processes per row, median shown (default: %(default)s)")
    p.set_defaults(func=run)
