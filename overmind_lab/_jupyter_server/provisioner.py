"""The ``overmind-lab-warm`` kernel provisioner: kernels forked from a zygote.

jupyter_client's ``LocalProvisioner`` whose ``launch_kernel`` asks the zygote to fork the kernel
(command, env, cwd, stdio, the server's process attributes); ``poll``, ``wait`` and the signals go
through a pidfd, never a reused pid.

Note [Never worse than plain]: any failure of the warm path launches a plain kernel
(``LocalProvisioner.launch_kernel``) and logs one line why; when no zygote runs, one is started
in the background for the next launch. More in docs/notes.md.

Note [Exit on the pidfd]: once the kernel's shutdown was requested, ``poll`` waits on the pidfd
(up to ``_SHUTDOWN_POLL_S``) instead of answering "alive" at once, so jupyter_client's 0.1 s
``_async_wait`` loop (``finish_shutdown``) returns the moment the kernel exits; ``wait`` also
wakes on the pidfd. jupyter_client's own timeouts still bound both (``asyncio.wait_for`` cancels
the wait), so a kernel that ignores its shutdown request is still sent SIGTERM, then SIGKILL.
A plain kernel's exit is waited for on a pidfd too. More in docs/notes.md.

Note [A standby for the restart]: when a restart's shutdown is requested, the next kernel is
forked at once from the last launch's request (``standby``) and stops before binding its sockets;
the launch tells it to go if it equals that launch, or lets it exit unstarted and forks its own.
More in docs/notes.md.

Note [A standby for a plain kernel's restart]: the first launch of a server with no zygote is
plain (the zygote starts meanwhile), and so was its first restart: the old kernel's exit (~1 s
of teardown: Note [A plain kernel's exit] in ``_launcher/plain``), then a fork on demand (~190
ms to a ready kernel), 1.57 s from the restart request to an SD 1.5 cell done. A plain launch is
recorded as a warm one is, so its restart forks a standby too while the old kernel exits, and
the plain kernel exits as a forked one does.

Note [A standby kept ready]: a standby forked at the restart request is ready ~110 ms later,
while the old kernel is gone in ~55 ms: the launch waited for it. So a second after a warm
launch (``standby_ahead_s``) the next kernel is forked already, and waits for that kernel's
restart (up to a day); one per server (the last launched kernel's: each costs ~25 MiB of its
own, ~65 MiB PSS). What it read before its sockets may have changed meanwhile: at the restart
its zygote checks its files while the old kernel shuts down (the zygote that answers must be the
standby's parent, not a replacement), and the config folders a kernel reads as it starts
(Jupyter's, IPython's profile) and its working directory must be as they were at its fork
(``_kernel_config_signature``); else it exits unstarted and the launch forks anew. More in
docs/notes.md.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner

from overmind_lab._common import inherit
from overmind_lab._common.zygote_client import (
    PLAIN_MODULE,
    WarmKernel,
    WarmUnavailable,
    check_early,
    is_ipykernel,
    kernel_argv,
    request_fork,
    timeline,
)

__all__ = ["WarmProvisioner"]

T = TypeVar("T")

#: Note [Exit on the pidfd]: the longest a ``poll`` after a shutdown request waits for the exit.
_SHUTDOWN_POLL_S = 1.0
#: Note [A standby kept ready]: how long a standby forked ahead waits for its restart.
_KEPT_READY_S = 24 * 3600.0
_CONFIG_SUFFIXES = (".py", ".json")
#: Note [A standby kept ready]: the one provisioner of this server whose kernel has one (the
#: last launched), weakly.
_kept: weakref.ref[WarmProvisioner] | None = None
_kept_lock = threading.Lock()


def _stdio_fds(kwargs: dict[str, Any]) -> list[int]:
    fds = []
    for name, default in (("stdin", -1), ("stdout", 1), ("stderr", 2)):
        value = kwargs.get(name)
        if value is None and default < 0:
            # as jupyter_client's launcher: a pipe whose write end is closed at once
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
            os.close(write_end)
            fds.append(read_end)
        elif value is None:
            fds.append(os.dup(default))
        elif isinstance(value, int) and value >= 0:
            fds.append(os.dup(value))
        elif hasattr(value, "fileno"):
            fds.append(os.dup(value.fileno()))
        else:
            for fd in fds:
                os.close(fd)
            raise WarmUnavailable(f"{name}={value!r} cannot be handed to a forked kernel")
    return fds


def _observe() -> dict[str, Any]:
    if not sys.platform.startswith("linux"):
        raise WarmUnavailable(f"warm kernels need Linux (this is {sys.platform})")
    try:
        return inherit.observe()
    except (OSError, ValueError, KeyError) as exc:
        raise WarmUnavailable(f"cannot read this server's process attributes: {exc}") from exc


class _Launch(NamedTuple):
    """A warm launch, as a later launch must equal it (Note [A standby for the restart])."""
    cmd: list[str]
    env: dict[str, str]
    cwd: str
    watch_parent: bool  # whether the kernel watches the server
    attributes: dict[str, Any]  # the server's process attributes (``inherit.observe``)
    stdio: dict[str, Any]  # the stdin, stdout and stderr arguments
    connection: dict[str, Any]  # the connection info


def _in_thread(fn: Callable[..., T], *args: Any,
               name: str = "overmind-lab-provisioner") -> Future[T]:
    """``fn(*args)`` in a new thread: a future any event loop can await (``wrap_future``)."""
    result: Future[T] = Future()

    def run() -> None:
        try:
            result.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - the awaiting side reads it
            result.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return result


def plain_argv(cmd: list[str]) -> list[str]:
    """The command of a warm kernelspec's plain kernel: ipykernel run by ``_launcher.plain``
    (Note [A plain kernel's exit]); any other command as it is."""
    return [cmd[0], "-m", PLAIN_MODULE, *cmd[3:]] if is_ipykernel(cmd) else list(cmd)


async def _until_process_exit(pid: int, timeout: float) -> None:
    """Note [Exit on the pidfd], for a plain kernel (a child of this process, not reaped yet):
    return once ``pid`` exited, or after ``timeout``."""
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone, or no pidfds (not Linux): jupyter_client polls
        return
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def fire() -> None:
        if not fut.done():
            fut.set_result(None)

    try:
        loop.add_reader(pidfd, fire)
    except (NotImplementedError, OSError, ValueError):
        os.close(pidfd)
        return
    try:
        await asyncio.wait([fut], timeout=timeout)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _identity(path: str, contents: bool = True) -> tuple[str, int, int, int] | None:
    """A file's or folder's identity; with ``contents`` its size and mtime too."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not contents:
        return (path, st.st_dev, st.st_ino, 0)
    return (path, st.st_ino, st.st_size, st.st_mtime_ns)


def _kernel_config_signature(launch: _Launch) -> tuple[tuple[str, int, int, int] | None, ...]:
    """Note [A standby kept ready]: what a kernel reads as it starts, before its sockets, by
    identity: the config folders (Jupyter's config path, the launch's ``JUPYTER_CONFIG_DIR``
    and ``JUPYTER_CONFIG_PATH``, IPython's folder and its default profile) and the names and
    identities of their ``.py`` and ``.json`` files, and which folder the working directory
    is."""
    from jupyter_core.paths import jupyter_config_path

    env = launch.env
    ipython = env.get("IPYTHONDIR") or os.path.join(env.get("HOME") or os.path.expanduser("~"),
                                                    ".ipython")
    folders = [*jupyter_config_path(), *filter(None, [env.get("JUPYTER_CONFIG_DIR")]),
               *filter(None, (env.get("JUPYTER_CONFIG_PATH") or "").split(os.pathsep)),
               ipython, os.path.join(ipython, "profile_default")]
    found: list[tuple[str, int, int, int] | None] = [_identity(launch.cwd, contents=False)]
    for folder in dict.fromkeys(folders):
        # which folder, not its mtime: a kernel writes its history beside its config
        found.append(_identity(folder, contents=False))
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        found.extend(_identity(os.path.join(folder, n)) for n in names
                     if n.endswith(_CONFIG_SUFFIXES))
    return tuple(found)


class _Standby(NamedTuple):
    """A standby being forked (a thread's future, not the event loop's: the launch may await
    it in another loop), and the launch it is forked for; one forked ahead (Note [A standby
    kept ready]) with what its kernel read as it started."""
    kernel: Future[WarmKernel]
    launch: _Launch
    ahead: bool = False
    config: tuple[tuple[str, int, int, int] | None, ...] = ()

    def waiting(self) -> bool:
        """Forked ahead, and not known to have failed or exited (Note [A standby kept
        ready])."""
        if not self.ahead:
            return False
        if not self.kernel.done():
            return True
        return self.kernel.exception() is None and not self.kernel.result().exited()

    def drop(self) -> None:
        """The standby exits (once forked, if it is still being forked)."""
        def close(fut: Future[WarmKernel]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                fut.result().close()

        self.kernel.add_done_callback(close)


class WarmProvisioner(LocalProvisioner):
    """A ``LocalProvisioner`` whose kernels are forked from an overmind-lab zygote."""
    warm: WarmKernel | None = None
    #: Note [Exit on the pidfd]: set by ``shutdown_requested``, cleared by the next launch.
    _shutting_down: bool = False
    _warm_exit: asyncio.Future[None] | None = None
    #: Note [Checked while the old kernel exits]: the last launch, warm or plain (Note [A standby
    #: for a plain kernel's restart]; what a launch like it must equal: :meth:`_launch_of`), and
    #: when a restart of it was requested
    #: (``time.monotonic()``).
    _launched: _Launch | None = None
    _restart_since: float | None = None
    _early_check: Future[tuple[str | None, int | None]] | None = None
    #: Note [A standby for the restart]: the next kernel, forked while the old one exits, or
    #: ahead (Note [A standby kept ready]: ``standby_ahead_s`` after a warm launch; ``None``:
    #: never ahead).
    _standby: _Standby | None = None
    standby_ahead_s: float | None = 1.0
    _ahead_timer: threading.Timer | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: Note [A standby kept ready]: ``_standby`` changes in the event loop's thread and in
        #: the timer's (jupyter_client's synchronous manager runs its loop only during calls)
        self._standby_lock = threading.Lock()

    @property
    def has_process(self) -> bool:
        return self.warm is not None or self.process is not None

    def _launch_of(self, cmd: list[str], kwargs: dict[str, Any],
                   attributes: dict[str, Any]) -> _Launch:
        env = dict(kwargs.get("env") or os.environ)
        cwd = str(kwargs.get("cwd") or os.getcwd())
        watch_parent = not kwargs.get("independent", False)
        if watch_parent:
            env["JPY_PARENT_PID"] = str(os.getpid())  # as jupyter_client's launcher does
        stdio = {name: kwargs.get(name) for name in ("stdin", "stdout", "stderr")}
        return _Launch(cmd, env, cwd, watch_parent, attributes, stdio, dict(self.connection_info))

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        cmd = kernel_argv(cmd)  # the kernelspec's argv is the launcher (``_launcher``)
        self._shutting_down = False
        checked_since, self._restart_since = self._restart_since, None
        with self._standby_lock:
            standby, self._standby = self._standby, None
        self._drop_warm()  # a previous kernel not waited for: its pidfd and reader go
        t0 = time.perf_counter()
        launch = self._launch_of(cmd, kwargs, {})
        env = launch.env
        timeline("provisioner.launch.start", env)
        try:
            # In the event loop's thread, which would fork a plain kernel (nice etc. per thread).
            launch = launch._replace(attributes=_observe())
            warm, standby = await self._standby_for_launch(standby, launch), None
            if warm is None:
                stdio = _stdio_fds(kwargs)
                try:
                    warm = await asyncio.to_thread(
                        request_fork, cmd, env, launch.cwd, stdio, launch.watch_parent,
                        launch.attributes, checked_since)
                finally:
                    for fd in stdio:
                        os.close(fd)
        except WarmUnavailable as exc:
            if standby is not None:
                standby.drop()
            self.log.warning("overmind-lab: launching a plain kernel: %s", exc)
            # Note [A plain kernel's exit] (``_launcher/plain``); Note [A standby for a plain
            # kernel's restart]: a restart of it forks the standby it can.
            info = await super().launch_kernel(plain_argv(cmd), **kwargs)
            self._launched = launch
            timeline("provisioner.launch.end", env, warm=False)
            return info
        self.warm = warm
        self._launched = launch
        self.pid = self.pgid = warm.pid
        self.cwd = launch.cwd
        timeline("provisioner.launch.end", env, warm=True, kernel=warm.pid)
        self.log.info("overmind-lab: warm kernel %d forked in %.0f ms", warm.pid,
                      (time.perf_counter() - t0) * 1000)
        if is_ipykernel(cmd) and self.standby_ahead_s is not None:  # Note [A standby kept ready]
            timer = threading.Timer(self.standby_ahead_s, self._fork_ahead, (launch, warm))
            timer.daemon = True
            self._ahead_timer = timer
            timer.start()
        return self.connection_info

    def _fork_ahead(self, launch: _Launch, warm: WarmKernel) -> None:
        """Note [A standby kept ready]: fork the next kernel for ``warm``'s restart (in the
        timer's thread, which the event loop's thread started: its nice value and affinity)."""
        global _kept
        with _kept_lock:  # one per server: the last launched kernel's
            other = _kept() if _kept is not None else None
            _kept = weakref.ref(self)
        if other is not None and other is not self:
            other._drop_kept()
        with self._standby_lock:
            if (self._shutting_down or self._standby is not None or self.warm is not warm
                    or self._launched is not launch or warm.exited()):
                return
            self._start_standby(launch, ahead=True)

    def _drop_kept(self) -> None:
        """Another kernel's standby is kept ready now: this one's exits (Note [A standby kept
        ready]); a standby forked for a restart in progress stays."""
        with self._standby_lock:
            standby = self._standby
            if standby is None or not standby.ahead or self._shutting_down:
                return
            self._standby = None
        standby.drop()
        timeline("provisioner.standby_dropped", standby.launch.env,
                 reason="another kernel's standby is kept ready")

    def _cancel_ahead(self) -> None:
        timer, self._ahead_timer = self._ahead_timer, None
        if timer is not None:
            timer.cancel()

    async def _standby_for_launch(self, standby: _Standby | None,
                                  launch: _Launch) -> WarmKernel | None:
        """Note [A standby for the restart]: the standby forked for this launch, told to go;
        ``None`` when there is none, or it was forked for another launch (then it exits)."""
        early, self._early_check = self._early_check, None
        if standby is None:
            return None
        try:
            kernel = await asyncio.wrap_future(standby.kernel)
        except Exception as exc:  # noqa: BLE001 - Note [Never worse than plain]: fork anew
            timeline("provisioner.standby_dropped", launch.env, reason=str(exc))
            return None
        why: str | None = None
        if standby.launch != launch:
            why = "the launch differs from the one it was forked for"
        elif standby.ahead:  # Note [A standby kept ready]: as it was when it was forked?
            why, checker = await (asyncio.wrap_future(early) if early is not None
                                  else asyncio.to_thread(check_early, launch.cmd, launch.env))
            if why is None and checker != _parent_pid(kernel.pid):
                why = "the zygote that forked it was replaced since (its files were not checked)"
            if why is None and _kernel_config_signature(launch) != standby.config:
                why = "a config folder or file, or the working directory, changed since its fork"
        if why is None and not kernel.go():
            why = "it exited before the launch"
        if why is None:
            timeline("provisioner.standby_go", launch.env, kernel=kernel.pid)
            return kernel
        timeline("provisioner.standby_dropped", launch.env, kernel=kernel.pid, reason=why)
        kernel.close()  # its go descriptor closes: it exits without starting
        return None

    async def shutdown_requested(self, restart: bool = False) -> None:
        self._shutting_down = True
        timeline("provisioner.shutdown_requested", restart=restart)
        if restart:
            self._drop_unread_shutdown_request()
        launched = self._launched
        self._cancel_ahead()
        if restart and launched is not None and self.has_process:
            # Note [Checked while the old kernel exits]: the zygote checks its files while
            # the old kernel shuts down; the launch says since when that check counts.
            self._restart_since = time.monotonic()
            with self._standby_lock:  # a standby kept ready, or one forked now
                standby = self._standby
                ready = standby is not None and standby.waiting()
                if is_ipykernel(launched.cmd) and not ready:
                    self._start_standby(launched)
            if not is_ipykernel(launched.cmd) or ready:  # a check the launch reads, or not
                self._early_check = _in_thread(check_early, launched.cmd, launched.env)
        await super().shutdown_requested(restart)

    def _drop_unread_shutdown_request(self) -> None:
        """Note [A shutdown request nobody read]: jupyter_client sent the old kernel its
        ``shutdown_request`` just now, on a control socket that lingers 100 ms when closed after
        the kernel's exit. A kernel that died before reading it (killed, crashed, or killed by
        jupyter_client for not exiting) leaves it queued, and a new kernel that binds the same
        port within the linger, as a forked one does, reads it and shuts down at once. With no
        linger the socket drops it at that close; one that was read is gone already. More in
        docs/notes.md."""
        control = getattr(self.parent, "_control_socket", None)
        if control is not None:
            control.linger = 0

    def _start_standby(self, launch: _Launch, ahead: bool = False) -> None:
        """Note [A standby for the restart]: fork the next kernel now, for a launch equal to
        the last one; the zygote checks its files meanwhile (Note [Checked while the old kernel
        exits]). ``ahead``: Note [A standby kept ready]. With ``_standby_lock`` held."""
        old, self._standby = self._standby, None
        if old is not None:
            old.drop()
        config = _kernel_config_signature(launch) if ahead else ()
        try:
            # now, in this thread: the event loop's (as a launch), or the timer's it started
            launch = launch._replace(attributes=_observe())
            stdio = _stdio_fds(launch.stdio)
        except WarmUnavailable:
            return

        def fork() -> WarmKernel:  # a failure is the future's: the launch forks anew
            try:
                return request_fork(launch.cmd, launch.env, launch.cwd, stdio,
                                    launch.watch_parent, launch.attributes, standby=True,
                                    standby_wait=_KEPT_READY_S if ahead else None)
            finally:
                for fd in stdio:
                    os.close(fd)

        timeline("provisioner.standby", launch.env, ahead=ahead)
        self._standby = _Standby(_in_thread(fork, name="overmind-lab-standby"), launch, ahead,
                                 config)

    def _drop_standby(self) -> None:
        with self._standby_lock:
            standby, self._standby = self._standby, None
        if standby is not None:
            standby.drop()

    async def _until_exit(self, warm: WarmKernel, timeout: float | None) -> None:
        """Note [Exit on the pidfd]: return once ``warm`` exited, or after ``timeout``."""
        if warm.exited():
            return
        fut = self._warm_exit
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def fire(fut: asyncio.Future[None] = fut) -> None:
                loop.remove_reader(warm.pidfd)
                if not fut.done():
                    fut.set_result(None)

            try:
                loop.add_reader(warm.pidfd, fire)
            except (NotImplementedError, OSError, ValueError):  # a loop without readers
                await asyncio.sleep(0.05 if timeout is None else min(timeout, 0.05))
                return
            self._warm_exit = fut
        await asyncio.wait([fut], timeout=timeout)

    def _drop_warm(self) -> None:
        warm, fut = self.warm, self._warm_exit
        self.warm = self._warm_exit = None
        if warm is None:
            return
        if fut is not None and not fut.done():
            fut.get_loop().remove_reader(warm.pidfd)  # before the pidfd is closed
            fut.cancel()
        warm.close()

    async def poll(self) -> int | None:
        if self.warm is None:
            # not reaped yet (``returncode`` unset): its pid is still its own
            if self._shutting_down and self.process is not None \
                    and self.process.returncode is None:
                await _until_process_exit(self.process.pid, _SHUTDOWN_POLL_S)
            return await super().poll()
        if self._shutting_down:
            await self._until_exit(self.warm, _SHUTDOWN_POLL_S)
        code = self.warm.returncode()
        if code is not None:
            timeline("provisioner.exit_seen", code=code)
        return code

    async def wait(self) -> int | None:
        if self.warm is None:
            return await super().wait()
        warm = self.warm
        while (code := warm.returncode()) is None:
            await self._until_exit(warm, None)
        self._drop_warm()
        return code

    async def send_signal(self, signum: int) -> None:
        if self.warm is None:
            await super().send_signal(signum)
            return
        self.warm.signal(signum)

    async def kill(self, restart: bool = False) -> None:
        if self.warm is None:
            await super().kill(restart)
            return
        self.warm.signal(signal.SIGKILL)

    async def terminate(self, restart: bool = False) -> None:
        if self.warm is None:
            await super().terminate(restart)
            return
        self.warm.signal(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        if self.warm is not None and self.warm.exited():
            self._drop_warm()
        if not restart:  # no launch follows
            self._cancel_ahead()
            self._drop_standby()
        await super().cleanup(restart)
