"""Length-prefixed JSON frames with file descriptors attached (SCM_RIGHTS): a 4-byte big-endian
length, a UTF-8 JSON object saying how many fds (``"nfds"``) rode with its first bytes.
:class:`Channel` is the blocking client side (timeouts), :class:`AsyncChannel` the daemon's.

Note [Descriptor ownership]: a received descriptor is the receiver's to close (or keep on purpose,
as the daemon does segment fds); a frame with unannounced descriptors is a protocol error and they
are closed.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from overmind_lab._errors import ProtocolError

if TYPE_CHECKING:
    import asyncio

__all__ = ["Channel", "AsyncChannel", "Frame", "MAX_FRAME", "MAX_FDS", "bind_private",
           "peer_credentials"]

_HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024
#: Linux refuses more than SCM_MAX_FD (253) descriptors in one message.
MAX_FDS = 250
_RECV_CHUNK = 256 * 1024
#: Note [Received descriptors close on exec]: without ``MSG_CMSG_CLOEXEC`` a received fd is
#: inheritable, and a kernel's ``!ls`` or ``subprocess`` would hold every segment (and a store's
#: writable ``.tmp``); ``fcntl`` afterwards leaves a race with another thread's fork. CPython
#: 3.11-3.13's ``socket.recv_fds`` drops its ``flags``, hence ``_recv_fds``.
_RECV_FLAGS = socket.MSG_CMSG_CLOEXEC
_FD_ARRAY_BYTES = socket.CMSG_LEN(MAX_FDS * array.array("i").itemsize)


def _recv_fds(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """Data, descriptors (close-on-exec) and message flags of one ``recvmsg``."""
    data, ancdata, flags, _ = sock.recvmsg(_RECV_CHUNK, _FD_ARRAY_BYTES, _RECV_FLAGS)
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), flags

#: A frame's JSON object as it arrives; each side gives it its type (``messages``) where read.
Frame = dict[str, object]


def encode(msg: Mapping[str, object], nfds: int) -> bytes:
    if nfds > MAX_FDS:
        raise ProtocolError(f"cannot send {nfds} file descriptors in one frame (max {MAX_FDS})")
    body = dict(msg)
    if nfds:
        body["nfds"] = nfds
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {MAX_FRAME} byte limit")
    return _HEADER.pack(len(data)) + data


class _FrameReader:
    """Reassembles frames and their descriptors from a byte stream."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.fds: list[int] = []

    def feed(self, data: bytes, fds: Sequence[int]) -> None:
        self.buf += data
        self.fds.extend(fds)

    def next_frame(self) -> tuple[Frame, list[int]] | None:
        if len(self.buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self.buf)
        if length > MAX_FRAME:
            self.close_fds()
            raise ProtocolError(f"peer announced a {length} byte frame (max {MAX_FRAME})")
        end = _HEADER.size + length
        if len(self.buf) < end:
            return None
        raw = bytes(self.buf[_HEADER.size:end])
        del self.buf[:end]
        try:
            msg = json.loads(raw)
        except ValueError as exc:
            self.close_fds()
            raise ProtocolError(f"peer sent a frame that is not JSON: {exc}") from exc
        if not isinstance(msg, dict):
            self.close_fds()
            raise ProtocolError("peer sent a frame that is not a JSON object")
        nfds = msg.pop("nfds", 0)
        if not isinstance(nfds, int):
            self.close_fds()
            raise ProtocolError(f"peer sent a frame with nfds {nfds!r}")
        if nfds > len(self.fds):
            self.close_fds()
            raise ProtocolError(f"frame announced {nfds} descriptors, {len(self.fds)} arrived")
        fds, self.fds = self.fds[:nfds], self.fds[nfds:]
        return msg, fds

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def _check_flags(flags: int, fds: Sequence[int]) -> None:
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("descriptors were truncated in transit (too many open files?)")


class Channel:
    """Blocking, timeout-bounded frame channel over a connected Unix socket."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.sock.settimeout(timeout)
        self._reader = _FrameReader()

    def settimeout(self, timeout: float) -> None:
        self.sock.settimeout(timeout)

    def send(self, msg: Mapping[str, object], fds: Sequence[int] = ()) -> None:
        data = encode(msg, len(fds))
        if fds:
            sent = socket.send_fds(self.sock, [data], list(fds))
            data = data[sent:]
        if data:
            self.sock.sendall(data)

    def recv(self) -> tuple[Frame, list[int]]:
        """The next frame and its descriptors. Raises ``ProtocolError`` on EOF."""
        while True:
            frame = self._reader.next_frame()
            if frame is not None:
                return frame
            data, fds, flags = _recv_fds(self.sock)
            _check_flags(flags, fds)
            if not data:
                self._reader.close_fds()
                for fd in fds:
                    os.close(fd)
                raise ProtocolError("the daemon closed the connection")
            self._reader.feed(data, fds)

    def close(self) -> None:
        self._reader.close_fds()
        self.sock.close()


class AsyncChannel:
    """The daemon's side: the same frames over a non-blocking socket, for asyncio."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._reader = _FrameReader()
        import asyncio  # the daemon's only: a loading process never imports it for us

        self._loop = asyncio.get_running_loop()

    async def _wait(self, writable: bool) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        fd = self.sock.fileno()
        if writable:
            self._loop.add_writer(fd, ready)
        else:
            self._loop.add_reader(fd, ready)
        try:
            await fut
        finally:
            if writable:
                self._loop.remove_writer(fd)
            else:
                self._loop.remove_reader(fd)

    async def send(self, msg: Mapping[str, object], fds: Sequence[int] = ()) -> None:
        data = memoryview(encode(msg, len(fds)))
        pending_fds = list(fds)
        while data:
            try:
                if pending_fds:
                    sent = socket.send_fds(self.sock, [data], pending_fds)
                    pending_fds = []
                else:
                    sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=True)
                continue
            data = data[sent:]

    async def recv(self) -> tuple[Frame, list[int]] | None:
        """The next frame, or ``None`` at a clean end of stream."""
        while True:
            frame = self._reader.next_frame()
            if frame is not None:
                return frame
            try:
                data, fds, flags = _recv_fds(self.sock)
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=False)
                continue
            except ConnectionResetError:
                return None
            _check_flags(flags, fds)
            if not data:
                self._reader.close_fds()
                for fd in fds:
                    os.close(fd)
                return None
            self._reader.feed(data, fds)

    def close(self) -> None:
        self._reader.close_fds()
        self.sock.close()


def bind_private(sock: socket.socket, path: str, backlog: int) -> None:
    """Bind ``sock`` at ``path`` mode 0600 from the start, and listen: by umask, not a ``chmod``
    after ``bind`` (another user could connect between); before the process starts threads."""
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(backlog)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
