"""The benchmark suite: plain vs first vs warm loads of real-architecture SD 1.5 models.

Not shipped: it lives in the checkout (``benchmarks/``, outside the wheel) and runs from
the repository root::

    make bench                                # the full suite (hours on 2 cores)
    python -m benchmarks                      # the same
    python -m benchmarks --quick              # tiny models, 2 runs per mode (tests)
    python -m benchmarks --only unet-fp16,pss # some cases

(An installed package measures the user's own model instead: ``overmind-lab bench PATH``,
``overmind_lab/measure.py``.)

It builds (once, kept under ``--models-dir``) random-weight models with the real Stable
Diffusion 1.5 architectures, then measures in fresh processes, with the page cache warm,
the load call alone for a plain ``from_pretrained``, the first load through the cache and
a warm load through the cache; the summed PSS of 4 processes holding the UNet warm vs
plainly; whether the warm object equals a plain load; the Jupyter kernel-restart
loop; and ``GET overmind-lab/api/v1/entries`` through a real Jupyter server with 100
entries (``rest-entries``, target median <= 50 ms); and ``decoding``: tokens per second of
speculative decoding, self-speculative decoding and early exit on the trained byte-level
pair of ``examples/decoding`` (trained once under ``--models-dir``, about 10 minutes;
target: best K >= 1.5x greedy); and ``warm-kernel``: plain vs warm kernels (forked from the
zygote) through a real Jupyter server, restart to the first ``kernel_info_reply`` and the SD
1.5 and Llama 1.1B load cells right after a restart (targets: SD cell <= 1 s and <= 0.15x
plain, Llama cell <= 0.5 s), and the summed PSS of 4 idle kernels (below 2 plain kernels).
Writes ``results.json``, ``results.md`` and ``results.png`` under ``--out``.

By default a private daemon on a temporary socket is used (and stopped at the end), so
the user's cache is never disturbed; ``--socket`` uses an existing daemon instead.

Importing this package is cheap (no torch). Its measuring processes run
``python -m benchmarks.<module>``: :func:`run` puts the checkout on their
``PYTHONPATH`` so that they find it from any working directory.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

__all__ = ["DEFAULT_MODELS_DIR", "DEFAULT_OUT", "ROOT", "add_arguments", "main", "run"]

DEFAULT_MODELS_DIR = "~/.cache/overmind-lab-bench/models"
DEFAULT_OUT = "./bench-results"
#: The checkout this suite runs from (``examples/`` lies there too).
ROOT = Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options, on any parser."""
    from benchmarks._cases import ALL_NAMES

    parser.add_argument("--models-dir", default=DEFAULT_MODELS_DIR,
                        help="where the random-weight SD 1.5 models are built once and kept "
                             "(default: %(default)s)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="directory for results.json, results.md, results.png and logs/ "
                             "(default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="fresh processes per case and mode (default: 5, or 2 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models and 2 runs per mode: checks that everything works "
                             "(for tests), the ratios mean nothing")
    parser.add_argument("--only", action="append", metavar="CASES",
                        help="comma-separated cases to run (repeatable): "
                             + ", ".join(ALL_NAMES) + "; or the groups unet, pipeline, loads")
    parser.add_argument("--socket",
                        help="use the daemon on this socket (started if needed, left running; "
                             "its entries are evicted!) instead of a private temporary daemon")
    parser.add_argument("--budget",
                        help="memory budget of the private daemon, e.g. 12GiB (default: the "
                             "daemon's default)")
    parser.add_argument("--batch", type=int, default=2,
                        help="processes that import at the same time while waiting for their "
                             "turn; timed loads always run one at a time (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds allowed for one process's load (default: 900, 180 with --quick)")


def compiled() -> None:
    """Byte-compile overmind_lab where it runs from source (an editable install): a user's wheel
    brings its ``.pyc`` files (pip compiles them), and a run must time what that user waits for,
    not Python compiling our modules again in every fresh process (``PYTHONDONTWRITEBYTECODE``
    keeps them from being written: 47 ms of a script's first load, 50 ms of a daemon's start).
    Files changed since ``make install`` are compiled here."""
    import compileall

    import overmind_lab

    compileall.compile_dir(os.path.dirname(overmind_lab.__file__), quiet=1, workers=0)


def run(args: argparse.Namespace) -> int:
    """Run the suite for parsed arguments; returns the exit status."""
    from benchmarks._suite import run_bench
    from overmind_lab._extras import require

    require("bench", "python -m benchmarks")
    compiled()
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)
    return run_bench(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=("Benchmark plain from_pretrained vs the first and the warm load through "
                     "the cache, each in fresh processes, on random-weight models with the real "
                     "Stable Diffusion 1.5 architectures (built once under --models-dir); also "
                     "the PSS of 4 processes holding the UNet, a correctness check, the "
                     "Jupyter kernel-restart loop and warm vs plain kernels through a real "
                     "Jupyter server. Writes results.json, results.md and "
                     "results.png under --out. Uses a private temporary daemon unless --socket "
                     "is given."))
    add_arguments(parser)
    return run(parser.parse_args(argv))
