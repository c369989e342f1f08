"""``overmind-lab``: the command line for the daemon and the cache.

::

    overmind-lab serve [--budget 12GiB] [--detach]   run the daemon (foreground by default)
    overmind-lab status [--json]                     is it running, memory, budget
    overmind-lab ls [--json]                         cached entries and their statistics
    overmind-lab evict KEY | --all                   drop entries (held copies keep working)
    overmind-lab refresh KEY                         reload an entry from its source
    overmind-lab stop [--force]                      stop the daemon and the zygotes
                                                     (--force: kill a daemon that does
                                                     not answer)
    overmind-lab bench PATH [--class NAME] [--dtype D] [--repeat N]
                                                     load times of a model folder: plain,
                                                     cold, warm, after a daemon restart
    overmind-lab kernel install|status|uninstall|restart-zygote [--json]
                                                     the warm kernel (forked from a zygote)
    overmind-lab run [-v] [--plain] SCRIPT|-m MODULE [ARGS...]
                                                     a script forked from the zygote, as
                                                     `python SCRIPT ARGS` runs it; its exit
                                                     status is the script's

Every command but ``bench`` (which runs a private daemon) and ``run`` takes ``--socket PATH``
(default ``$OVERMIND_LAB_SOCKET`` or the per-user socket). Exit status (:data:`EXIT_STATUS`,
also in ``overmind-lab --help``; ``run`` exits with its script's): 0 success, 1 failure (also:
an optional dependency is missing; the message names the extra to install), 2 usage error, 3 no
daemon to talk to (none runs, for
``status``, ``evict KEY`` and ``refresh``; or one that does not answer, or a socket folder or
server that cannot be trusted: the message says which and what to do), 130 interrupted
(Ctrl-C), 141 the reader of the output went away (``overmind-lab status | head -3``), as
for a command that SIGPIPE ended.

Note [Nothing to do is no error]: with no daemon running, ``stop`` (nothing to stop), ``ls``
(nothing cached) and ``evict --all`` (nothing to evict) say so and exit 0, so that an uninstall
script under ``set -e`` goes on; a daemon that is there but cannot be used still fails them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from overmind_lab._common.sizes import format_size
from overmind_lab._errors import DaemonUnavailable, NotAnswering, OvermindError

__all__ = ["EXIT_STATUS", "main"]

FAILURE = 1
USAGE = 2
NOT_RUNNING = 3
INTERRUPTED = 128 + 2  # as a shell reports a command that SIGINT ended
BROKEN_PIPE = 128 + 13  # as a shell reports a command that SIGPIPE ended

#: The exit statuses, as ``overmind-lab --help`` lists them.
EXIT_STATUS = f"""\
exit status:
  0    success; also stop, ls and evict --all when no daemon runs (nothing to do)
  {FAILURE}    failure (a missing optional dependency: the message names the extra)
  {USAGE}    usage error
  {NOT_RUNNING}    no daemon to talk to: none runs (status, evict KEY, refresh), or the one
       there does not answer, or its socket's folder or server is not to be trusted
  {INTERRUPTED}  interrupted (Ctrl-C)
  {BROKEN_PIPE}  the reader of the output went away (overmind-lab ls | head)"""


def _client(args: argparse.Namespace) -> Any:
    from overmind_lab._loading.client import Client

    return Client(args.socket)


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def cmd_status(args: argparse.Namespace) -> int:
    status = _client(args).status()
    if args.json:
        _print_json(status)
    elif status.get("not_answering"):
        print(f"not answering  pid {status.get('pid', '?')} on {status['socket']}")
        print(f"               {status['error']}")
    elif "error" in status and "no overmind-lab daemon is listening" not in status["error"]:
        # a folder or server not to trust, another user's daemon: whether one runs is unknown
        print(f"unavailable (socket {status['socket']})")
        print(f"  {status['error']}")
    elif not status["running"]:
        print(f"not running (socket {status['socket']}); a load starts it, as does "
              "`overmind-lab serve --detach`")
    else:
        print(f"running      pid {status['pid']}, up {status['uptime_seconds']:.0f} s, "
              f"version {status['version']}")
        print(f"socket       {status['socket']}")
        print(f"cached       {format_size(status['cached_bytes'])} in {status['entries']} "
              f"entries, budget {format_size(status['budget_bytes'])}")
        if status.get("held_files"):  # Note [What an entry costs]
            print(f"held         {format_size(status.get('held_bytes', 0))} of your own files "
                  f"({status['held_files']} held open, not in the budget)")
        if status.get("refolding"):  # Note [Refolding a held source]
            print(f"folios       {status['refolding']} held file(s) still in small page-cache "
                  "folios: refolded once no process maps them")
        tier = status.get("tier", "memfd")
        where = (f"files in {status.get('cache_dir')}" if tier == "file" else
                 f"memory (memfd tier: {status.get('tier_reason') or 'fallback'})")
        print(f"tier         {where}")
        print(f"disk         {format_size(status.get('disk_bytes', 0))} on disk, "
              f"{format_size(status.get('memfd_bytes', 0))} in memfds, "
              f"{format_size(status.get('resident_bytes', 0))} resident in memory")
        print(f"evicted      {format_size(status['evicted_mapped_bytes'])} still mapped "
              "by processes")
        gone = status.get("source_gone_recent") or []
        if status.get("source_gone_entries"):
            from overmind_lab._common.display import format_ago

            last = gone[0] if gone else None
            print(f"let go       {status['source_gone_entries']} entr"
                  f"{'y' if status['source_gone_entries'] == 1 else 'ies'} whose source file "
                  "went away" + (f" (last: {last['name']}, {last['why']}, "
                                 f"{format_ago(last['at'])})" if last else ""))
        print(f"memory       {format_size(status['memory_available_bytes'])} available of "
              f"{format_size(status['memory_total_bytes'])}")
    return 0 if status["running"] else NOT_RUNNING


def _absent(exc: DaemonUnavailable) -> bool:
    """Whether ``exc`` says only that no daemon listens: no socket file, or the stale one of a
    daemon that is gone (Note [Nothing to do is no error]); not a daemon that does not answer,
    nor a folder or server not to trust."""
    return (not isinstance(exc, NotAnswering)
            and isinstance(exc.__cause__, (FileNotFoundError, ConnectionRefusedError)))


def _nothing_cached(client: Any, key: str, what: str = "") -> DaemonUnavailable:
    return DaemonUnavailable(f"no daemon running on {client.path}: nothing is cached, so no "
                             f"entry matches {key!r}{what}")


def cmd_ls(args: argparse.Namespace) -> int:
    from overmind_lab._common.display import ENTRY_HEADERS, entry_row, format_ago, text_table

    client = _client(args)
    try:
        entries = client.entries()
    except DaemonUnavailable as exc:
        if not _absent(exc):
            raise
        if args.json:
            _print_json([])
        else:
            print(f"nothing cached: no daemon running on {client.path}")
        return 0
    if args.json:
        _print_json(entries)
        return 0
    if not entries:
        print("no cached entries")
    else:
        rows = [[e["key"][:12], *entry_row(e)] for e in entries]
        print(text_table(("key", *ENTRY_HEADERS), rows, right=(2, 3, 4, 5, 6, 7, 8)))
    for gone in client.status().get("source_gone_recent") or []:  # Note [Sources let go]
        print(f"let go: {gone['key'][:12]} {gone['name']}: {gone['why']} "
              f"({format_ago(gone['at'])}): {gone['path']}")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    if args.all == bool(args.key):
        print("overmind-lab evict: give a KEY or --all (not both)", file=sys.stderr)
        return USAGE
    client = _client(args)
    try:
        evicted = client.evict_all() if args.all else client.evict(args.key)
    except DaemonUnavailable as exc:
        if not _absent(exc):
            raise
        if not args.all:
            raise _nothing_cached(client, args.key) from exc
        if args.json:  # Note [Nothing to do is no error]
            _print_json({"evicted": []})
        else:
            print(f"evicted 0 entries: no daemon running on {client.path}")
        return 0
    if args.json:
        _print_json({"evicted": evicted})
    else:
        print(f"evicted {len(evicted)} entr{'y' if len(evicted) == 1 else 'ies'}")
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        entry = client.refresh(args.key)
    except DaemonUnavailable as exc:
        if not _absent(exc):
            raise
        raise _nothing_cached(client, args.key, " to refresh (a load caches it, and starts the "
                              "daemon)") from exc
    if args.json:
        _print_json(entry)
    else:
        print(f"refreshing {entry['name']} in the background "
              f"(see `overmind-lab ls`): {entry['refresh']['message']}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from overmind_lab._common.naming import socket_path
    from overmind_lab._jupyter_server.kernelspec import stop_zygotes

    client = _client(args)
    stopped = client.stop(force=args.force)
    if not stopped:
        _check_absent(client)
    # Note [Stopping a zygote]: every zygote beside the socket, of every Python environment;
    # their kernels run on
    zygotes = stop_zygotes(socket_path(args.socket).parent)
    # Note [Nothing to do is no error]: nothing left running either way, `set -e` scripts go on
    print("stopped" if stopped else f"no daemon running on {client.path}")
    if zygotes:
        print(f"stopped {len(zygotes)} zygote(s): {', '.join(map(str, zygotes))}")
    return 0


def _check_absent(client: Any) -> None:
    """After a ``stop`` that found no daemon to stop (``Client.stop`` is ``False`` for any
    :class:`DaemonUnavailable`): raise unless none listens, so that a socket folder not to
    trust, a daemon of another user or one that hung up on ``stop`` is an error, not "no
    daemon running"."""
    from overmind_lab._common.naming import log_path

    try:
        client.connect().close()
    except DaemonUnavailable as exc:
        if not _absent(exc):
            raise
        return
    raise DaemonUnavailable(f"the daemon on {client.path} did not take the stop request; "
                            f"its log {log_path(client.path)} may say why, and "
                            "`overmind-lab stop --force` kills it")


def cmd_serve(args: argparse.Namespace) -> int:
    from overmind_lab._daemon.process import serve_command

    if not args.detach:
        return serve_command(args)
    from overmind_lab._common.naming import log_path, socket_path
    from overmind_lab._loading.client import Client

    path = socket_path(args.socket)
    client = Client(path)
    was_running = client.status()["running"]  # status() never starts a daemon
    code = serve_command(args)
    if code == 0:
        status = client.status()
        what = "already running" if was_running else "started"
        print(f"daemon {what}: pid {status.get('pid')}, socket {status.get('socket', path)}, "
              f"log {log_path(path)}")
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overmind-lab", description="Warm model reloads for notebook development.",
        epilog=EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"overmind-lab {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, func: Any, help: str, json_flag: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        if name != "serve":
            p.add_argument("--socket", help="daemon socket (default: $OVERMIND_LAB_SOCKET "
                                            "or the per-user socket)")
        return p

    from overmind_lab._daemon.process import add_serve_arguments

    add_serve_arguments(add("serve", cmd_serve, "run the cache daemon", json_flag=False))
    add("status", cmd_status, "show whether the daemon runs and what it holds (exit status "
        f"{NOT_RUNNING} when it does not)")
    add("ls", cmd_ls, "list cached entries with their statistics (none when no daemon runs: "
        "exit status 0)")
    evict = add("evict", cmd_evict, "evict entries (processes holding them keep working)")
    evict.add_argument("key", nargs="?", help="entry key, unique key prefix, or exact name")
    evict.add_argument("--all", action="store_true", help="evict every entry")
    refresh = add("refresh", cmd_refresh, "reload an entry from its source")
    refresh.add_argument("key", help="entry key or unique key prefix")
    stop = add("stop", cmd_stop, "stop the daemon and the warm-kernel zygotes (none running: "
               "exit status 0)", json_flag=False)
    stop.add_argument("--force", action="store_true",
                      help="kill a daemon that does not answer or does not stop in time")
    from overmind_lab import measure
    from overmind_lab._jupyter_server import kernelspec as spec

    measure.add_parser(sub)
    spec.add_parser(sub)
    run = sub.add_parser(
        "run", add_help=False, help="run a script (or -m MODULE) forked from the zygote, with "
        "torch, diffusers and transformers imported; `overmind-lab run -h` for more",
        description="run a script in a process forked from the zygote")
    run.add_argument("args", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)
    for command in sub.choices.values():  # for the errors ``main`` reports in its usage
        command.set_defaults(command_parser=command)
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    # (``overmind-lab run`` itself goes to ``run.main`` from ``_console``, parsing nothing)
    from overmind_lab._launcher import run

    return run.main(args.args)


def _version() -> str:
    from overmind_lab import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # in the command's own usage, not the top level's (``kernel install --bogus``)
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return code
    except BrokenPipeError:
        # The reader stopped reading (`overmind-lab ls | head`): not an error of ours.
        # Point stdout at /dev/null so that the flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE
    except OvermindError as exc:
        from overmind_lab._common.trust import Untrusted  # not imported by a `run` that goes plain

        print(f"overmind-lab: {exc}", file=sys.stderr)
        # a folder not to trust: no daemon to use either
        return NOT_RUNNING if isinstance(exc, (DaemonUnavailable, Untrusted)) else FAILURE
    except KeyboardInterrupt:
        return INTERRUPTED



if __name__ == "__main__":
    raise SystemExit(main())
