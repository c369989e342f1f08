"""The frame reader in-process: partial frames, descriptors, closing every fd on error.

Real socketpairs and real descriptors (memfds), no daemon.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Iterator

import pytest

from overmind_lab._common.protocol import MAX_FRAME, Channel, _FrameReader, encode
from overmind_lab._errors import ProtocolError
from tests.conftest import is_open


def memfd(tag: str) -> int:
    fd = os.memfd_create(f"olt-protocol-{tag}", os.MFD_CLOEXEC)
    os.write(fd, tag.encode())
    return fd


def same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, Channel]]:
    """A raw writing end and a Channel reading the other end."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    chan = Channel(b, timeout=60.0)
    yield a, chan
    a.close()
    chan.close()


def test_a_frame_split_anywhere_is_reassembled() -> None:
    data = encode({"op": "status", "x": "é" * 10}, 0) + encode({"op": "list"}, 0)
    for cut in range(1, len(data)):
        reader = _FrameReader()
        reader.feed(data[:cut], [])
        first = reader.next_frame()
        reader.feed(data[cut:], [])
        frames = [first] if first is not None else []
        while (frame := reader.next_frame()) is not None:
            frames.append(frame)
        assert frames == [({"op": "status", "x": "é" * 10}, []), ({"op": "list"}, [])], cut


def test_partial_frames_over_a_socket(pair: tuple[socket.socket, Channel]) -> None:
    raw, chan = pair
    data = encode({"op": "lookup", "key": "k" * 100}, 0)
    raw.sendall(data[:3])  # not even a whole header
    raw.sendall(data[3:50])
    raw.sendall(data[50:])
    assert chan.recv() == ({"op": "lookup", "key": "k" * 100}, [])


def test_descriptors_arriving_with_the_first_byte(pair: tuple[socket.socket, Channel]) -> None:
    raw, chan = pair
    fds = [memfd("a"), memfd("b")]
    try:
        data = encode({"op": "store"}, len(fds)) + encode({"op": "list"}, 0)
        socket.send_fds(raw, [data[:1]], fds)  # the descriptors ride on the first byte
        raw.sendall(data[1:])
        msg, got = chan.recv()
        assert msg == {"op": "store"} and len(got) == 2
        assert all(same_file(g, f) for g, f in zip(got, fds, strict=True))
        assert chan.recv() == ({"op": "list"}, [])  # the next frame gets none of them
        for fd in got:
            os.close(fd)  # Note [Descriptor ownership]: the receiver's to close
    finally:
        for fd in fds:
            os.close(fd)


def test_channel_send_attaches_descriptors(pair: tuple[socket.socket, Channel]) -> None:
    raw, chan = pair
    reader = Channel(raw, timeout=60.0)
    fd = memfd("c")
    try:
        chan.send({"op": "store"}, [fd])
        msg, got = reader.recv()
        assert msg == {"op": "store"} and len(got) == 1 and same_file(got[0], fd)
        os.close(got[0])
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad", [
    b"not json",
    json.dumps([1, 2]).encode(),
    json.dumps({"op": "store", "nfds": 3}).encode(),  # two descriptors arrive, three announced
], ids=["not-json", "not-an-object", "too-few-fds"])
def test_every_descriptor_is_closed_on_a_bad_frame(bad: bytes) -> None:
    fds = [memfd("x"), memfd("y")]
    reader = _FrameReader()
    reader.feed(struct.pack(">I", len(bad)) + bad, fds)
    with pytest.raises(ProtocolError):
        reader.next_frame()
    assert not any(is_open(fd) for fd in fds) and reader.fds == []


def test_every_descriptor_is_closed_on_an_oversized_frame() -> None:
    fds = [memfd("z")]
    reader = _FrameReader()
    reader.feed(struct.pack(">I", MAX_FRAME + 1), fds)
    with pytest.raises(ProtocolError, match="byte frame"):
        reader.next_frame()
    assert not is_open(fds[0])


def test_a_bad_frame_over_a_socket_leaks_no_descriptor(
        pair: tuple[socket.socket, Channel]) -> None:
    raw, chan = pair
    fds = [memfd("p"), memfd("q")]
    bad = b"{nope"
    socket.send_fds(raw, [struct.pack(">I", len(bad)) + bad], fds)
    for fd in fds:
        os.close(fd)  # the sender's copies; the ones in flight are the receiver's
    before = open_fds()
    with pytest.raises(ProtocolError, match="not JSON"):
        chan.recv()
    assert open_fds() == before


def test_end_of_stream_closes_pending_descriptors(pair: tuple[socket.socket, Channel]) -> None:
    raw, chan = pair
    fd = memfd("r")
    data = encode({"op": "store"}, 1)
    socket.send_fds(raw, [data[:2]], [fd])  # half a header, then the peer goes away
    os.close(fd)
    raw.shutdown(socket.SHUT_WR)
    before = open_fds()
    with pytest.raises(ProtocolError, match="closed the connection"):
        chan.recv()
    assert open_fds() == before


def test_received_descriptors_do_not_cross_exec(pair: tuple[socket.socket, Channel]) -> None:
    """Note [Received descriptors close on exec]: a program the receiver runs (a shell a
    kernel starts) must not hold the segments it received. The sender's descriptor is
    inheritable on purpose: the flag must come from the receiving side."""
    import fcntl
    import subprocess
    import sys

    raw, chan = pair
    fd = os.memfd_create("olt-protocol-exec", 0)  # inheritable, unlike the others
    try:
        socket.send_fds(raw, [encode({"op": "store"}, 1)], [fd])
        _msg, [got] = chan.recv()
        assert fcntl.fcntl(got, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        # What an exec'd child really holds, with Python's own fd closing turned off.
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.listdir('/proc/self/fd')))"],
            close_fds=False, capture_output=True, text=True, check=True, timeout=60)
        assert str(got) not in json.loads(child.stdout.replace("'", '"'))
        os.close(got)
    finally:
        os.close(fd)
