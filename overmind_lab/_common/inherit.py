"""What a kernel inherits from the process that starts it, besides env and cwd.

Note [Inherited process attributes]: the provisioner :func:`observe` s its own attributes (in
the event loop's thread: nice, affinity and scheduling are per thread); the zygote refuses
what no process can change in itself (:func:`refusal`: namespaces, uids, capabilities,
``NoNewPrivs``, seccomp, cgroup hierarchies, ``RLIMIT_STACK``); the forked child :func:`apply` s
the rest first (umask, nice, scheduling, affinity, ``oom_score_adj``, limits, groups, cgroups;
ignored signals with the rest of the signals)
and exits before any kernel code where not allowed, so the launch goes plain. More in
docs/notes.md.
"""

from __future__ import annotations

import os
import re
import resource
import signal
from pathlib import Path
from typing import Any

__all__ = ["RLIMITS", "NotApplicable", "observe", "refusal", "apply"]

#: Every resource limit by name (``RLIMIT_OFILE`` is an alias of ``RLIMIT_NOFILE``).
RLIMITS = sorted(n for n in dir(resource) if n.startswith("RLIMIT_") and n != "RLIMIT_OFILE")
#: ``/proc/self/status`` lines a process cannot change in itself (or only one way).
FIXED_STATUS = ("Uid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts", "time")


class NotApplicable(Exception):  # noqa: N818 - a reason, raised in the child only
    """The child cannot take on an attribute of the server's; the message says which."""


def _status() -> dict[str, str]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = " ".join(value.split())
    return out


def _namespaces() -> dict[str, int]:
    out = {}
    for name in NAMESPACES:
        try:
            out[name] = os.stat(f"/proc/self/ns/{name}").st_ino
        except OSError:
            continue
    return out


def observe() -> dict[str, Any]:
    """This process's inheritable attributes, as seen from the calling thread."""
    status = _status()
    sched = os.sched_getscheduler(0)
    return {
        "umask": int(status["Umask"], 8),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "sched": [sched, os.sched_getparam(0).sched_priority],
        "affinity": sorted(os.sched_getaffinity(0)),
        "oom_score_adj": int(Path("/proc/self/oom_score_adj").read_text()),
        "rlimits": {n: list(resource.getrlimit(getattr(resource, n))) for n in RLIMITS},
        "gid": [int(g) for g in status["Gid"].split()[:3]],
        "groups": sorted(os.getgroups()),
        "cgroup": Path("/proc/self/cgroup").read_text(),
        "fixed": {k: status.get(k, "") for k in FIXED_STATUS},
        "namespaces": _namespaces(),
        "ignored_signals": _ignored_signals(status["SigIgn"]),
    }


def _ignored_signals(mask: str) -> list[int]:
    """The signals an exec'd child of this process starts with ignored: ``SIG_IGN`` survives
    ``execve``, except SIGPIPE and SIGXFSZ, which ``subprocess`` (``restore_signals``) resets
    and which Python ignores on its own at start. A warm kernel sets the same ignored
    (``_forked/become.py``); a server started as a shell's background job ignores SIGINT and
    SIGQUIT, and so do its plain kernels."""
    bits = int(mask, 16)
    restored = {int(getattr(signal, n)) for n in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, n)}
    return [n for n in range(1, 65) if bits >> (n - 1) & 1 and n not in restored]


def _cgroups(text: str) -> dict[str, str]:
    """``hierarchy-id:controllers`` -> path, from a ``/proc/<pid>/cgroup`` text."""
    out = {}
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        out[f"{hid}:{controllers}"] = path
    return out


def refusal(wanted: dict[str, Any]) -> str | None:
    """Why no child of this process can get ``wanted`` (from :func:`observe`), or None."""
    mine = observe()
    for name, ino in wanted.get("namespaces", {}).items():
        if mine["namespaces"].get(name, ino) != ino:
            return f"the Jupyter server runs in another {name} namespace than the zygote"
    for key, value in wanted.get("fixed", {}).items():
        if mine["fixed"].get(key) != value:
            return (f"the Jupyter server's {key} ({value}) differs from the zygote's "
                    f"({mine['fixed'].get(key)})")
    stack = wanted.get("rlimits", {}).get("RLIMIT_STACK")
    if stack is not None and list(stack) != mine["rlimits"]["RLIMIT_STACK"]:
        return (f"the Jupyter server's RLIMIT_STACK {stack} differs from the zygote's "
                f"{mine['rlimits']['RLIMIT_STACK']} (fixed when a process starts)")
    if "cgroup" in wanted and set(_cgroups(wanted["cgroup"])) != set(_cgroups(mine["cgroup"])):
        return "the Jupyter server's cgroup hierarchies differ from the zygote's"
    return None


def _unescape(field: str) -> str:
    """A mountinfo field: spaces, tabs, newlines and backslashes are octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_dir(key: str, path: str) -> Path:
    """The directory of cgroup ``path`` of hierarchy ``key`` in this mount namespace."""
    controllers = set(key.partition(":")[2].split(",")) - {""}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], set(fields[sep + 3].split(","))
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if (fstype == "cgroup2" and not controllers) or (
                fstype == "cgroup" and controllers and controllers <= options):
            if root == "/" or path == root or path.startswith(root.rstrip("/") + "/"):
                rel = path[len(root.rstrip("/")):] if root != "/" else path
                return Path(point + rel)
    raise NotApplicable(f"no mount of the cgroup hierarchy {key} shows {path}")


def _move_cgroups(wanted: str) -> None:
    mine = _cgroups(Path("/proc/self/cgroup").read_text())
    for key, path in _cgroups(wanted).items():
        if mine.get(key) == path:
            continue
        target = _cgroup_dir(key, path) / "cgroup.procs"
        try:
            target.write_text(f"{os.getpid()}\n")
        except OSError as exc:
            raise NotApplicable(f"cannot move the kernel into the Jupyter server's cgroup "
                                f"{key}:{path} ({exc.strerror or exc})") from exc


def _set(what: str, fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise NotApplicable(f"cannot set the Jupyter server's {what} in the forked "
                            f"kernel ({reason})") from exc


def apply(wanted: dict[str, Any]) -> None:
    """Take on ``wanted`` (from :func:`observe` in the server); raise NotApplicable."""
    if not wanted:
        return
    mine = observe()
    if wanted["cgroup"] != mine["cgroup"]:
        _move_cgroups(wanted["cgroup"])
    if wanted["groups"] != mine["groups"]:
        _set(f"supplementary groups {wanted['groups']}", os.setgroups, wanted["groups"])
    if wanted["gid"] != mine["gid"]:
        _set(f"group ids {wanted['gid']}", os.setresgid, *wanted["gid"])
    for name, limits in wanted["rlimits"].items():
        if name != "RLIMIT_STACK" and list(limits) != mine["rlimits"].get(name):
            _set(f"{name} {limits}", resource.setrlimit, getattr(resource, name), tuple(limits))
    if wanted["sched"] != mine["sched"]:
        policy, priority = wanted["sched"]
        _set(f"scheduling policy {policy} priority {priority}", os.sched_setscheduler, 0,
             policy, os.sched_param(priority))
    if wanted["nice"] != mine["nice"]:
        _set(f"nice {wanted['nice']}", os.setpriority, os.PRIO_PROCESS, 0, wanted["nice"])
    if wanted["affinity"] != mine["affinity"]:
        _set(f"CPU affinity {wanted['affinity']}", os.sched_setaffinity, 0, wanted["affinity"])
    if wanted["oom_score_adj"] != mine["oom_score_adj"]:
        _set(f"oom_score_adj {wanted['oom_score_adj']}",
             Path("/proc/self/oom_score_adj").write_text, f"{wanted['oom_score_adj']}\n")
    os.umask(wanted["umask"])
