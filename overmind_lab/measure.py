"""``overmind-lab bench PATH``: how long your own model takes to load, plain and cached.

::

    overmind-lab bench ./my-unet                       # class from the folder's files
    overmind-lab bench ./sd15 --dtype float16 --repeat 5
    overmind-lab bench ./llm --class AutoModelForCausalLM

PATH: a folder ``save_pretrained`` wrote (diffusers or transformers model, pipeline or
tokenizer). Rows: a plain ``from_pretrained``, the first load through the cache (cold), a warm
load, and a warm load after the daemon restarted; for each the load call, the first touch of
every parameter and buffer (what the first forward pays to fault pages in), and the imports. The
imports (torch, the library, the class, overmind_lab) are timed once, in a fresh process; each
load is then measured in a process forked from it after those imports, as a kernel after a
restart meets its load (Note [One import, forked measurements] in ``_measuring.py``): a tiny model
takes seconds, not minutes. Progress and the time left go to stderr as it runs. A private daemon
and cache (temporary socket and folder) serve the measurement and are stopped and removed at the
end, also on Ctrl-C (exit 130) or a failure: the user's own cache is untouched.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from overmind_lab._common.display import format_seconds, text_table
from overmind_lab._common.naming import CACHE_DIR_ENV, SOCKET_ENV, default_cache_dir, log_path
from overmind_lab._common.sizes import format_size
from overmind_lab._errors import OvermindError

__all__ = ["add_parser", "detect", "resolve", "run"]

ROWS = (("plain", "plain from_pretrained"), ("cold", "first load, cached (cold)"),
        ("warm", "warm load"), ("restart", "warm load after a daemon restart"))

#: The libraries a class name without a module is looked for in, in this order.
LIBRARIES = ("transformers", "diffusers")

USAGE = 2  # exit status of a usage error, as argparse's


class UsageError(OvermindError):
    """A bad ``--class``: exit status 2, the message names the fix."""


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP while the bench runs: everything it started is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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


# -- which class: decided before anything starts ---------------------------------------------

def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _source_names(module: str) -> set[str]:
    """The class-like names among the string constants of a top-level package's
    ``__init__.py``: a lazy package (diffusers) lists its public names there, read in
    milliseconds where importing it takes seconds (diffusers imports torch)."""
    if "." in module:
        return set()
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec else None
        if not origin or not origin.endswith(".py"):
            return set()
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"))
    except (ImportError, ValueError, OSError, SyntaxError):
        return set()
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and n.value.isidentifier() and n.value[:1].isupper()}


def _find(modules: list[str], name: str) -> str | None:
    """The first of ``modules`` that has ``name``: from their sources where they list it, else
    from the imported modules' names (a lazy module lists them without importing the class)."""
    for module in modules:
        if name in _source_names(module):
            return module
    for module in modules:
        if module not in sys.modules:
            print(f"bench: looking for {name} in {module} (importing it)", file=sys.stderr,
                  flush=True)
        try:
            if name in dir(importlib.import_module(module)):
                return module
        except Exception:  # noqa: BLE001 - a module that does not import has no class for us
            continue
    return None


def _names(module: str) -> set[str]:
    found = _source_names(module)
    imported = sys.modules.get(module)
    if imported is not None:
        found |= {n for n in dir(imported) if n[:1].isupper()}
    return found


def _unknown(name: str, modules: list[str], detected: str | None) -> UsageError:
    where = " or ".join(modules) or "transformers or diffusers (neither is installed)"
    close = difflib.get_close_matches(name, sorted(set().union(*map(_names, modules))), n=3)
    example = detected or (close[0] if close else "UNet2DConditionModel")
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    leave = (f", or leave --class out to use the one the folder's files name ({detected})"
             if detected else "")
    return UsageError(f"no class {name} in {where}{hint}: give --class a class of "
                      f"{' or '.join(modules) or 'transformers or diffusers'}, as in --class "
                      f"{example}{leave}")


def resolve(library: str | None, name: str, fallback: str, given: str | None,
            detected: str | None = None) -> tuple[str, str]:
    """``(module, class)`` to load with, checked before anything starts: ``given`` is the
    user's ``--class`` (``detect``'s ``library`` then comes from it where it names a module),
    ``detected`` the class the folder's files name (for the error's hint). Raises
    :class:`UsageError` for an unknown ``--class``, :class:`OvermindError` for a class the folder
    names that the installed library lacks."""
    if given and "." in given:
        modules = [given.rpartition(".")[0]]
    else:  # the folder's library first; a class named alone is looked for in both
        modules = [m for m in dict.fromkeys([library, *LIBRARIES]) if m and _installed(m)]
        if not given:
            modules = modules[:1]
    for candidate in (name,) if given else (name, fallback):
        module = _find(modules, candidate)
        if module is not None:
            return module, candidate
    if given:
        raise _unknown(name, modules, detected)
    where = modules[0] if modules else "transformers or diffusers"
    raise OvermindError(f"the folder's files name the class {name}, which the installed {where} "
                        f"does not have: upgrade {where}, or name the class with --class")


# -- progress and the time left ---------------------------------------------------------------

#: Before anything is measured: a fresh process's imports (s), a guess that the measured imports
#: replace (Note [The bench's estimate]; 7-10 s with diffusers or transformers on 2 busy cores).
IMPORT_GUESS = 8.0
#: Note [The bench's estimate]: a row not measured yet, from the plain load measured: the
#: cold load stores what it loaded, warm loads map it.
FROM_PLAIN = {"cold": 2.0, "warm": 0.5, "restart": 0.5}

# Note [The bench's estimate]: the total shown is the time so far plus the steps left, each at
# the time the last step of its kind took; a kind not seen yet is guessed: the imports
# (IMPORT_GUESS), reading the files and a load from the model's size (300 MB/s, a load 0.3 s
# more) until the plain load is measured, then from it (FROM_PLAIN). Shown up front and after
# every step.


class Progress:
    """One line on stderr per step: the time so far, the total it will take, what was done."""

    def __init__(self, steps: list[str], guesses: dict[str, float],
                 out: IO[str] | None = None) -> None:
        self.left = list(steps)
        self.taken: dict[str, float] = {}
        self.guesses = guesses
        self.out = out if out is not None else sys.stderr
        self.start = time.monotonic()
        self.mark = self.start

    def _cost(self, kind: str) -> float:
        if kind in self.taken:
            return self.taken[kind]
        if kind in FROM_PLAIN and "plain" in self.taken:
            return FROM_PLAIN[kind] * self.taken["plain"]
        return self.guesses.get(kind, 0.5)

    def total(self) -> float:
        return time.monotonic() - self.start + sum(map(self._cost, self.left))

    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self.start
        print(f"bench [{elapsed:5.1f} s of about {self.total():.0f} s] {text}",
              file=self.out, flush=True)

    def done(self, kind: str, text: str) -> None:
        """The next step of ``kind`` is done (timed from the previous step's end)."""
        now = time.monotonic()
        self.taken[kind] = now - self.mark
        self.mark = now
        if kind in self.left:
            self.left.remove(kind)
        self.say(text)


# -- the processes it starts ------------------------------------------------------------------

class Measuring:
    """The measuring process (``_measuring.py``) and the children it forks: one process group,
    its own session (a Ctrl-C reaches the bench, which stops the group)."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, spec: dict[str, Any], env: dict[str, str]) -> None:
        from overmind_lab._measuring import PARENT_ONLY_ENV

        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "overmind_lab._measuring"], env={**env, **PARENT_ONLY_ENV},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                start_new_session=True)
        self.ask_raw(spec)

    def ask_raw(self, message: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line.strip() else {"error": "the measuring process ended"}
        if "error" in reply:
            raise OvermindError(f"{reply['error']}\n{self.tail()}".rstrip())
        return dict(reply)

    def measure(self, cached: bool) -> dict[str, Any]:
        self.ask_raw({"cached": cached})
        return self.answer()

    def tail(self) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            return ""
        return f"its output ended with:\n{text[-3000:]}" if text else ""

    def stop(self) -> None:
        """Ask it to end (end of its input); kill its group where it does not."""
        if self.proc is None:
            return
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:  # not reaped: its pid is still its group's id
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            # a child it was measuring with is reaped by init: returned once it is gone
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.01)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP end the bench as Ctrl-C does (its processes stopped)."""
    def stop(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """Cleanup runs to its end: a second Ctrl-C (or SIGTERM) waits until it is done."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _stop_daemon(client: Any, pids: set[int]) -> None:
    """Stop the private daemon; one that outlived its stop (it should not) is killed, if the pid
    still names it (its command line holds the private socket: a reused pid is left alone)."""
    try:
        client.stop(force=True)
    except OvermindError:
        pass
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(client.path).encode() in cmdline.split(b"\0"):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _files(path: Path) -> list[Path]:
    return [f for f in sorted(path.rglob("*")) if f.is_file()]


def _read_files(files: list[Path]) -> None:
    """Read every file once: each row starts with them in the page cache."""
    for f in files:
        with f.open("rb") as fh:
            while fh.read(1 << 24):
                pass


# -- the bench ---------------------------------------------------------------------------------

def _row(label: str, runs: list[dict[str, Any]], imports: float) -> list[str]:
    med = {k: statistics.median(r[k] for r in runs) for k in ("load", "touch")}
    return [label, format_seconds(med["load"]), format_seconds(med["touch"]),
            format_seconds(med["load"] + med["touch"]), format_seconds(imports),
            ",".join(sorted({r["outcome"] for r in runs}))]


def _measure_rows(measuring: Measuring, client: Any, repeat: int, progress: Progress,
                  daemon_pids: set[int]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key, _ in ROWS}
    for key, label in ROWS:
        if key == "cold":
            daemon_pids.add(int(client.start().get("pid") or 0))
            progress.done("daemon", "private daemon started")
        for i in range(repeat):
            if key == "cold":
                client.evict_all()
            if key == "restart":
                had = _settled(client, progress)
                client.stop(force=True)
                restarted = client.start()
                daemon_pids.add(int(restarted.get("pid") or 0))
                if int(restarted.get("entries") or 0) < had:
                    progress.say(f"the restarted daemon restored {restarted.get('entries')} of "
                                 f"{had} entries; its log ends:\n{_log_tail(client.path)}")
            result = measuring.measure(cached=key != "plain")
            runs[key].append(result)
            progress.done(key, f"{label} {i + 1}/{repeat}: load {format_seconds(result['load'])}"
                               f", first touch {format_seconds(result['touch'])}"
                               f" ({result['outcome']})")
    return runs


#: How long the restart row waits for the daemon to put what it stored on disk.
SETTLE_SECONDS = 120.0


def _settled(client: Any, progress: Progress) -> int:
    """Wait until the daemon has every entry on disk (``Client.wait_settled``), so that the
    restart row restarts a cache as a user's would be, not one stopped halfway through
    writing; the entries it has."""
    from overmind_lab._loading.client import UNSETTLED

    status = client.status()
    if any(status.get(k) for k in UNSETTLED):
        progress.say("waiting for the daemon to finish writing its entries to disk")
        status = client.wait_settled(SETTLE_SECONDS)
    return int(status.get("entries") or 0)


def _log_tail(socket: Path, lines: int = 8) -> str:
    try:
        text = log_path(socket).read_text(errors="replace")
    except OSError as exc:
        return f"  (no log: {exc})"
    return "\n".join("  " + line for line in text.splitlines()[-lines:])


def _report(runs: dict[str, list[dict[str, Any]]], imports: dict[str, float],
            library: str, repeat: int) -> None:
    base = imports.get("torch", 0.0) + imports.get(library, 0.0)
    ours = imports.get("overmind_lab", 0.0)
    rows = [_row(label, runs[key], base + (ours if key != "plain" else 0.0))
            for key, label in ROWS]
    print(text_table(["", "load", "first touch", "load + touch", "imports", "outcome"], rows,
                     right=(1, 2, 3, 4)))

    def fresh(key: str) -> str:
        return format_seconds(statistics.median(r["load"] + r["touch"] for r in runs[key])
                              + base + (ours if key != "plain" else 0.0))

    print(f"\nA fresh process (a kernel after a restart) waits imports + load + first touch: "
          f"{fresh('plain')} plain, {fresh('warm')} warm, {fresh('restart')} warm after a "
          "daemon restart.")
    print(textwrap.fill(
        f"load: the from_pretrained call alone, median of {repeat}; first touch: summing every "
        "parameter and buffer after it (what the first forward pays to fault pages in). "
        f"imports: timed once, in a fresh process: torch {format_seconds(imports.get('torch'))}"
        f", {library} and the class {format_seconds(imports.get(library))}, overmind_lab "
        f"{format_seconds(ours)} (cached rows). Each load ran in its own process, forked from "
        "that one after its imports.", 92))


def _spec_env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                TRANSFORMERS_VERBOSITY="error", DIFFUSERS_VERBOSITY="error")


def _bench(args: argparse.Namespace, path: Path, library: str, name: str) -> int:
    from overmind_lab._loading.client import Client

    files = _files(path)
    size = sum(f.stat().st_size for f in files)
    repeat = args.repeat
    steps = ["read", "imports", *["plain"] * repeat, "daemon", *["cold"] * repeat,
             *["warm"] * repeat, *["restart"] * repeat]
    load_guess = 0.3 + size / 300e6
    progress = Progress(steps, {"read": size / 300e6, "imports": IMPORT_GUESS, "daemon": 0.5,
                                "plain": load_guess, "cold": 2 * load_guess,
                                "warm": 0.5 * load_guess, "restart": 0.5 * load_guess + 0.5})
    cache_parent = default_cache_dir().parent
    cache_parent.mkdir(parents=True, exist_ok=True)  # the user's file system, its tier
    cache = Path(tempfile.mkdtemp(prefix="overmind-lab-bench-", dir=cache_parent))
    run_dir = Path(tempfile.mkdtemp(prefix="overmind-lab-bench-"))
    socket = run_dir / "daemon.sock"
    saved = dict(os.environ)
    os.environ.update({SOCKET_ENV: str(socket), CACHE_DIR_ENV: str(cache / "cache")})
    client = Client(socket)
    daemon_pids: set[int] = set()
    measuring = Measuring(run_dir / "measuring.log")
    try:
        print(f"overmind-lab bench: {name} ({library}) from {path} ({format_size(size)}), dtype "
              f"{args.dtype or 'the default'}; private daemon on {socket}", flush=True)
        progress.say(f"reading the model's files into the page cache, importing torch, "
                     f"{library} and overmind_lab once in a fresh process, then {4 * repeat} "
                     "loads, each in a process forked from it")
        _read_files(files)
        progress.done("read", f"read {format_size(size)} into the page cache")
        spec = {"path": str(path), "library": library, "class": name, "dtype": args.dtype,
                "env": _spec_env()}
        measuring.start(spec, spec["env"])
        imports = measuring.answer()["imports"]
        progress.done("imports", "imports: " + ", ".join(
            f"{k} {format_seconds(v)}" for k, v in imports.items()))
        runs = _measure_rows(measuring, client, repeat, progress, daemon_pids)
    finally:
        with _uninterrupted():
            measuring.stop()
            _stop_daemon(client, daemon_pids - {0})
            os.environ.clear()
            os.environ.update(saved)
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(run_dir, ignore_errors=True)
    progress.say("done; the private daemon is stopped and its cache removed")
    _report(runs, imports, library, repeat)
    return 0


def run(args: argparse.Namespace) -> int:
    """Check the folder and the class, measure, print the table; whatever happens, everything
    it started is stopped and its private cache removed."""
    from overmind_lab._extras import EXTRAS, require

    path = Path(args.path).expanduser().resolve()
    if not path.exists():
        raise OvermindError(f"{args.path} does not exist: give the folder save_pretrained wrote")
    library, name, fallback = detect(path, args.cls)
    top = (library or "").partition(".")[0]
    require(top if top in EXTRAS else "torch", "overmind-lab bench")
    if top and top not in EXTRAS and not _installed(top):
        raise OvermindError(f"no module named {top}: install it, or give --class a class of "
                            "diffusers or transformers")
    detected = _detected(path) if args.cls else None
    try:
        module, cls = resolve(library, name, fallback, args.cls, detected)
    except UsageError as exc:
        print(f"overmind-lab bench: error: {exc}", file=sys.stderr)
        return USAGE
    try:
        with _signals_interrupt():
            return _bench(args, path, module, cls)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(f"\novermind-lab bench: interrupted ({signal.Signals(signum).name}); stopped the "
              "processes it started and removed its private cache", file=sys.stderr)
        return 128 + int(signum)


def _detected(path: Path) -> str | None:
    """The class the folder's files name, if they name one."""
    try:
        return detect(path)[1]
    except OvermindError:
        return None


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_parser(subparsers: Any) -> None:
    """Register ``bench`` on the CLI's subparsers."""
    text = ("measure how long a model folder takes to load: plain, first and warm through "
            "the cache, after a daemon restart; imports timed once in a fresh process, each "
            "load in a process forked after them, on a private daemon")
    p = subparsers.add_parser("bench", help=text, description=text)
    p.add_argument("path", help="a folder save_pretrained wrote (diffusers or transformers "
                                "model, pipeline or tokenizer)")
    p.add_argument("--class", dest="cls", metavar="NAME",
                   help="the class to load with, e.g. UNet2DConditionModel, "
                        "StableDiffusionPipeline, AutoModel (default: from the folder's files)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="dtype= passed to from_pretrained (default: the library's)")
    p.add_argument("--repeat", type=_at_least_one, default=3,
                   help="loads per row, median shown (default: %(default)s)")
    p.set_defaults(func=run)
