"""The cache as the daemon leaves it on disk, read by the daemon that restores it and by a load
that finds no daemon (Note [A hit from the disk]): the index file's format, a segment file's
trailer, a file's identity, and the checks a saved entry passes before it is served (its source
files' signatures, its libraries' versions). The standard library only."""

from __future__ import annotations

import json
import os
import stat
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

from overmind_lab._common.dists import dist_info_versions, version_of

__all__ = ["Corrupt", "INDEX_NAME", "SEG_SUFFIX", "PAGE", "FORMAT_VERSION", "MAX_INDEX",
           "IDENTITY", "identity", "align", "file_bytes", "trailer", "parse_trailer",
           "index_file", "parse_index", "held_source_changed", "source_changed",
           "versions_changed"]

INDEX_NAME = "index"
SEG_SUFFIX = ".seg"
PAGE = 4096
FORMAT_VERSION = 1
#: An index larger than this is not one (a planted device or a runaway file).
MAX_INDEX = 256 << 20
_TRAILER = struct.Struct(">8sIQI")
_SEG_MAGIC = b"OVLSEG\x00\x01"
_INDEX_HEADER = struct.Struct(">8sQI")
_INDEX_MAGIC = b"OVLIDX\x00\x01"

#: What a file's identity is made of (Note [File signatures] in ``_loading/keys.py``).
IDENTITY = ("dev", "ino", "size", "mtime_ns", "ctime_ns")
_IDENTITY_WORDS = ("device", "inode", "size", "mtime", "ctime")


class Corrupt(Exception):
    """A segment or index file failed its checks; the message says which and why."""


def identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def file_bytes(size: int) -> int:
    """The size of the file of a segment of ``size`` data bytes."""
    return align(max(size, 1)) + PAGE


def trailer(size: int, crc: int) -> bytes:
    fields = _TRAILER.pack(_SEG_MAGIC, FORMAT_VERSION, size, crc)
    return (fields + struct.pack(">I", zlib.crc32(fields))).ljust(PAGE, b"\0")


def parse_trailer(raw: bytes, path: Path) -> tuple[int, int]:
    """``(size, crc)`` from a segment file's trailer (read at ``align(max(size, 1))``)."""
    if len(raw) < _TRAILER.size + 4:
        raise Corrupt(f"segment file {path} has no trailer")
    fields = raw[:_TRAILER.size]
    (check,) = struct.unpack_from(">I", raw, _TRAILER.size)
    magic, version, size, crc = _TRAILER.unpack(fields)
    if magic != _SEG_MAGIC or zlib.crc32(fields) != check:
        raise Corrupt(f"segment file {path} has no valid trailer (overwritten or torn)")
    if version != FORMAT_VERSION:
        raise Corrupt(f"segment file {path} has format version {version}")
    return int(size), int(crc)


def trailer_bytes() -> int:
    """How much of a trailer ``parse_trailer`` reads."""
    return _TRAILER.size + 4


def check_segment_file(fd: int, size: int, crc: object, path: Path) -> os.stat_result:
    """The ``fstat`` of the open segment file ``fd`` once its size and trailer match its
    index record's ``size`` and ``crc``; ``Corrupt`` (saying what differs) otherwise. The
    restored daemon and a load's hit from the disk make this same check."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Corrupt(f"segment file {path} is not a regular file ({_file_type(st.st_mode)})")
    if st.st_size != file_bytes(size):
        raise Corrupt(f"segment file {path} has {st.st_size} bytes, {file_bytes(size)} "
                      "expected (truncated or torn)")
    found = parse_trailer(os.pread(fd, trailer_bytes(), align(max(size, 1))), path)
    if found != (size, crc):
        raise Corrupt(f"segment file {path} holds {found}, its index record says "
                      f"{(size, crc)}")
    return st


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return f"mode {mode:o}"


def index_file(body: bytes) -> bytes:
    """The index file's bytes for a JSON ``body``: magic, length, crc32, body."""
    return _INDEX_HEADER.pack(_INDEX_MAGIC, len(body), zlib.crc32(body)) + body


def parse_index(raw: bytes, path: Path) -> dict[str, Any]:
    """The body of an index file's bytes; raises :class:`Corrupt` saying what is wrong."""
    if len(raw) < _INDEX_HEADER.size:
        raise Corrupt(f"index {path} is truncated ({len(raw)} bytes)")
    magic, length, crc = _INDEX_HEADER.unpack_from(raw)
    body = raw[_INDEX_HEADER.size:]
    if magic != _INDEX_MAGIC:
        raise Corrupt(f"index {path} is not an overmind-lab index (bad magic)")
    if len(body) != length:
        raise Corrupt(f"index {path} has {len(body)} body bytes, {length} expected "
                      "(truncated or torn)")
    if zlib.crc32(body) != crc:
        raise Corrupt(f"index {path} does not match its checksum")
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise Corrupt(f"index {path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict) or value.get("version") != FORMAT_VERSION:
        raise Corrupt(f"index {path} has format version "
                      f"{value.get('version') if isinstance(value, dict) else '?'}, "
                      f"this daemon reads {FORMAT_VERSION}")
    return value


def held_source_changed(source: dict[str, Any], st: os.stat_result) -> str | None:
    """Why the open file ``st`` (a held source, as its record ``source`` names it: ``path`` and
    ``IDENTITY``) is not the file recorded, or no longer the file its path names; ``None``."""
    then = [source.get(k) for k in IDENTITY]
    now = identity(st)
    if now != then:
        what = ", ".join(k for k, a, b in zip(IDENTITY, then, now, strict=True) if a != b)
        return f"the source file {source.get('path')} was changed in place ({what})"
    try:  # the path's own inode: a file renamed over it is not the one we hold
        there = os.stat(str(source.get("path")))
    except OSError as exc:
        return f"the source file {source.get('path')} is gone ({exc.strerror})"
    if (there.st_dev, there.st_ino) != (st.st_dev, st.st_ino):
        return (f"the source file {source.get('path')} was replaced by another file "
                f"(inode {st.st_ino} -> {there.st_ino})")
    return None


def source_changed(source: Any) -> str | None:
    """Why a recorded source signature (Note [File signatures]) no longer matches the disk,
    or ``None``; one of another shape (an older client's) counts as changed."""
    if not isinstance(source, dict) or "local" not in source:
        return None
    root = Path(str(source["local"]))
    files = source.get("files")
    try:
        if isinstance(files, list) and files and isinstance(files[0], int):
            if len(files) != 5:
                return f"the signature of {root} was recorded without inode and ctime"
            return None if identity(root.stat()) == files else f"{root} changed"
        if not isinstance(files, list):
            return f"the signature of {root} is malformed"
        for record in files:
            if not isinstance(record, list) or len(record) != 6:
                return f"the signature of {root} was recorded without inode and ctime"
            rel, *then = record
            now = identity((root / str(rel)).stat())
            if now != then:
                what = ", ".join(name for name, a, b in zip(_IDENTITY_WORDS, then, now,
                                                            strict=True) if a != b)
                return f"the source file {root / str(rel)} changed ({what})"
    except FileNotFoundError as exc:
        return f"the source file {exc.filename} is gone"
    except (OSError, TypeError, ValueError) as exc:
        return f"the source {root} cannot be checked: {exc}"
    return None


def versions_changed(validate: dict[str, Any]) -> str | None:
    """Which recorded library version differs here, or ``None`` (same interpreter only)."""
    versions = validate.get("versions")
    if validate.get("python") != sys.executable or not isinstance(versions, dict):
        return None
    found: dict[str, str] | None = None
    for lib, recorded in versions.items():
        if lib == "format":
            continue
        if lib == "python":
            import platform  # 2 ms, where an entry records the Python version

            now = platform.python_version()
        else:
            if found is None:  # Note [Versions without METADATA]: folder names, as the key's
                found = dist_info_versions()
            installed = version_of(lib, found)
            if installed is None:
                continue  # a module that is no distribution: the daemon cannot tell
            now = installed
        if now.split("+")[0] != str(recorded).split("+")[0]:
            return f"{lib} changed from {recorded} to {now}"
    return None
