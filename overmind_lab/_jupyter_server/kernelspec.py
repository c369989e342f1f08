"""``overmind-lab kernel install|status|uninstall|restart-zygote``.

``install`` writes a kernelspec that selects the ``overmind-lab-warm`` provisioner, with an argv
(``python -m overmind_lab._launcher -f {connection_file}``) that is warm where a frontend runs it
itself; a folder it cannot write is an error that says which and what to do instead
(:class:`KernelspecNotWritable`). ``status`` and ``restart-zygote`` see only this Python
environment's zygotes (Note [Environments share an interpreter]); :func:`stop_zygotes` (for
``overmind-lab stop``) stops every zygote of this user.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from overmind_lab._common.messages import ReplaceReply, ZygoteStatus
from overmind_lab._common.trust import check_folder
from overmind_lab._common.zygote_client import LAUNCHER_MODULE as LAUNCHER
from overmind_lab._common.zygote_client import ask
from overmind_lab._common.zygote_paths import environment, zygote_dir, zygote_processes
from overmind_lab._errors import OvermindError
from overmind_lab._extras import require

__all__ = ["DEFAULT_NAME", "DISPLAY_NAME", "KernelspecNotWritable", "kernel_json", "install",
           "uninstall", "zygotes", "restart_zygotes", "stop_zygotes", "add_parser"]

DEFAULT_NAME = "overmind-lab-warm"
DISPLAY_NAME = "Python 3 (warm, overmind-lab)"
PROVISIONER = "overmind-lab-warm"


def kernel_json(display_name: str = DISPLAY_NAME, env: dict[str, str] | None = None,
                python: str = sys.executable) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "argv": [python, "-m", LAUNCHER, "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": True,
                     "kernel_provisioner": {"provisioner_name": PROVISIONER}},
    }
    if env:
        spec["env"] = env
    return spec


class KernelspecNotWritable(OvermindError):
    """The kernelspec's folder cannot be written (a read-only home, a data folder under a file, a
    system folder without root); the message names the folder and what to do instead."""


def _where(manager: Any, name: str, user: bool, prefix: str | None) -> str:
    """The folder ``install_kernel_spec`` writes the kernelspec ``name`` into."""
    try:
        return str(manager._get_destination_dir(name, user=user, prefix=prefix))
    except Exception:  # noqa: BLE001 - a private method of jupyter_client: only for the message
        return f"the Jupyter kernels folder for {name!r}"


def _advice(user: bool, prefix: str | None) -> str:
    if user:
        return ("Set JUPYTER_DATA_DIR to a folder you can write (Jupyter must then run with the "
                "same JUPYTER_DATA_DIR, or have that folder on JUPYTER_PATH), or install into "
                "this Python environment with --sys-prefix, or under a prefix you can write "
                "with --prefix PATH.")
    if prefix is not None:
        return ("Install for this user with --user, or under a prefix you can write with "
                "--prefix PATH.")
    return ("Install for this user with --user, or into this Python environment with "
            "--sys-prefix.")


def _failed(doing: str, where: str, exc: OSError, advice: str) -> KernelspecNotWritable:
    path = f" ({exc.filename})" if exc.filename and str(exc.filename) != where else ""
    return KernelspecNotWritable(
        f"cannot {doing} {where}: {exc.strerror or exc}{path}. {advice}")


def install(name: str = DEFAULT_NAME, display_name: str = DISPLAY_NAME, *,
            user: bool = False, prefix: str | None = None,
            env: dict[str, str] | None = None) -> str:
    """Install the warm kernelspec; returns its directory. Raises :class:`KernelspecNotWritable`
    (an ``OvermindError``) where the folder cannot be written."""
    require("jupyter", "the warm kernel", ["jupyter_client", "ipykernel"])
    from jupyter_client.kernelspec import KernelSpecManager

    manager = KernelSpecManager()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "kernel.json").write_text(json.dumps(kernel_json(display_name, env), indent=1))
        try:
            return str(manager.install_kernel_spec(tmp, kernel_name=name, user=user,
                                                   prefix=prefix))
        except OSError as exc:
            raise _failed(f"install the kernelspec {name!r} into",
                          _where(manager, name, user, prefix), exc,
                          _advice(user, prefix)) from None


def uninstall(name: str = DEFAULT_NAME) -> str | None:
    """Remove the kernelspec ``name``; its directory, or ``None`` if there is none. Raises
    :class:`KernelspecNotWritable` where it cannot be removed."""
    require("jupyter", "overmind-lab kernel uninstall", ["jupyter_client"])
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    manager = KernelSpecManager()
    try:
        return str(manager.remove_kernel_spec(name))
    except (NoSuchKernel, KeyError):  # jupyter_client raises KeyError for an unknown name
        return None
    except OSError as exc:
        where = str(manager.find_kernel_specs().get(name, name))
        raise _failed("remove the kernelspec", where, exc,
                      "Remove that folder as a user who may write it (it may have been "
                      "installed with --sys-prefix or system-wide).") from None


def _memory(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    out[key.lower() + "_bytes"] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _own(directory: Path) -> list[tuple[Path, ZygoteStatus]]:
    """The sockets and status of the zygotes in ``directory`` of this Python environment.
    Raises ``Untrusted`` for a folder another user could write (Note [Trust no neighbour]):
    "no zygote running" would hide that no zygote of ours can run there."""
    check_folder(directory, "zygote socket")
    mine = environment(sys.executable)
    out = []
    for path in sorted(directory.glob("zygote-*.sock")):
        try:
            status = cast(ZygoteStatus, ask(path, {"op": "status"}))
        except OSError:  # gone meanwhile, or another user's socket (Untrusted): not ours
            continue
        if environment(str(status.get("python", ""))) == mine:
            out.append((path, status))
    return out


def zygotes(directory: Path | None = None) -> list[dict[str, Any]]:
    """The status of every zygote of this environment in ``directory`` (default: the zygote dir)."""
    directory = zygote_dir() if directory is None else directory
    out = []
    for _path, status in _own(directory):
        shown: dict[str, Any] = {k: v for k, v in status.items() if k != "ok"}
        shown.update(_memory(int(status["pid"])))
        out.append(shown)
    return out


def restart_zygotes(directory: Path | None = None) -> list[int]:
    """Ask every zygote of this environment to start a replacement (fresh imports) and retire."""
    directory = zygote_dir() if directory is None else directory
    pids = []
    for path, _status in _own(directory):
        try:
            pids.append(int(cast(ReplaceReply, ask(path, {"op": "replace"}))["pid"]))
        except (OSError, KeyError):
            continue
    return pids


def stop_zygotes(directory: Path | None = None, timeout: float = 30.0) -> list[int]:
    """Stop every zygote of this user whose socket is in ``directory`` (default: the zygote
    directory), of every Python environment: booting, serving or retiring. Each is sent SIGTERM
    (Note [Stopping a zygote]), and SIGKILL if it has not exited ``timeout`` s later; returns
    their pids, sorted, once all have exited. The kernels forked from them run on."""
    if not sys.platform.startswith("linux"):
        return []  # no zygote runs elsewhere
    directory = zygote_dir(create=False) if directory is None else directory
    pidfds: dict[int, int] = {}
    try:
        for pid in zygote_processes(directory):
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # exited meanwhile
            pidfds[pid] = fd
        # Found by command line, then held by pidfd: a pid reused in between is no longer a
        # zygote of this directory, so it is let go before it is signalled.
        again = set(zygote_processes(directory))
        for pid in [p for p in pidfds if p not in again]:
            os.close(pidfds.pop(pid))
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 60.0)):
            for fd in pidfds.values():
                try:
                    signal.pidfd_send_signal(fd, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while _running(pidfds) and time.monotonic() < deadline:
                select.select(_running(pidfds), [], [], deadline - time.monotonic())
            if not _running(pidfds):
                break
    finally:
        for fd in pidfds.values():
            os.close(fd)
    for pid in pidfds:  # the temporary socket of one that was stopped while it imported
        for tmp in directory.glob(f"zygote-*.sock.{pid}"):
            try:
                tmp.unlink()
            except OSError:
                pass
    return sorted(pidfds)


def _running(pidfds: dict[int, int]) -> list[int]:
    """The pidfds of ``pidfds`` whose process has not exited."""
    return [fd for fd in pidfds.values() if not select.select([fd], [], [], 0)[0]]


def _print(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def cmd_kernel(args: argparse.Namespace) -> int:
    from overmind_lab._common.sizes import format_size

    if args.socket:
        os.environ["OVERMIND_LAB_SOCKET"] = args.socket
    if args.action == "install":
        path = install(args.name, args.display_name, user=args.user,
                       prefix=sys.prefix if args.sys_prefix else args.prefix)
        result: Any = {"installed": path, "name": args.name}
        text = f"installed kernelspec {args.name!r} in {path}"
    elif args.action == "uninstall":
        removed = uninstall(args.name)
        result = {"removed": removed, "name": args.name}
        text = f"removed {removed}" if removed else f"no kernelspec named {args.name!r}"
    elif args.action == "restart-zygote":
        pids = restart_zygotes()
        result = {"restarted": pids}
        text = (f"replacing {len(pids)} zygote(s): {pids}" if pids else "no zygote running")
    else:
        result = zygotes()
        lines = [f"zygote {z['pid']}  {z['python']}  {z['preloaded']} modules "
                 f"({', '.join(z['preload_roots'][:8])}...)  "
                 f"RSS {format_size(z.get('rss_bytes', 0))} PSS "
                 f"{format_size(z.get('pss_bytes', 0))}  forks {z['forks']}  last fork "
                 f"{z['last_fork_ms'] or 0:.1f} ms"
                 + (f"  REFUSES: {z['refusal']}" if z.get("refusal") else "")
                 + "".join(f"\n  differs from a fresh kernel: {d}"
                           for d in z.get("differences", []))
                 for z in result]
        text = "\n".join(lines) or "no zygote running"
    if args.json:
        _print(result)
    else:
        print(text)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("kernel", help="the warm kernel: install, status, uninstall, "
                       "restart-zygote", description="Warm kernels forked from a zygote "
                       "that has imported torch, diffusers and transformers.")
    p.set_defaults(func=cmd_kernel)
    p.add_argument("action", choices=["install", "status", "uninstall", "restart-zygote"])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user")
    where.add_argument("--sys-prefix", action="store_true",
                       help="install into this environment (sys.prefix)")
    where.add_argument("--prefix", metavar="PATH",
                       help="install into PATH/share/jupyter/kernels (Jupyter finds it where "
                       "PATH/share/jupyter is on JUPYTER_PATH)")
    p.add_argument("--name", default=DEFAULT_NAME, help=f"kernelspec name ({DEFAULT_NAME})")
    p.add_argument("--display-name", default=DISPLAY_NAME,
                   help=f"name shown in Jupyter ({DISPLAY_NAME!r})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--socket", help="daemon socket; the zygotes live beside it")
