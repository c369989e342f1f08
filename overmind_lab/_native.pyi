"""Native helpers of overmind-lab (pybind11, ``native/native.cpp``).

Byte-moving work Python cannot do well: prefaulting of mappings and byte comparison.
Every function takes objects that support the buffer protocol (``bytes``,
``bytearray``, ``memoryview``, ``mmap.mmap``, numpy arrays...), obtains their pointers
with the GIL held and releases the GIL for the heavy work. The
module does not link libtorch: pass ``memoryview``s or numpy views of tensors, not
tensors.

``threads=0`` everywhere means ``min(os.cpu_count(), 8)``; larger values are capped at
256. Work totalling less than 4 MiB runs on the calling thread.
"""

import sys
from typing import Literal

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

def prefault(
    buf: Buffer,
    threads: int = 0,
    method: Literal["auto", "populate", "touch"] = "auto",
) -> Literal["populate", "touch"]:
    """Make the pages of ``buf`` resident for reading; no byte changes.

    The range is widened to page boundaries. ``madvise(MADV_POPULATE_READ)`` (Linux
    >= 5.14) is used where the kernel supports it (result ``"populate"``); otherwise one
    byte per page is read (result ``"touch"``). For a ``MAP_PRIVATE`` mapping this maps
    the shared page-cache pages, it copies nothing. ``method`` forces one way (tests).

    Raises:
        OSError: the kernel cannot populate the range (``EFAULT``: e.g. a file mapping
            past the end of its file), where reading the pages would crash the process.
        ValueError: ``method="populate"`` on a kernel without ``MADV_POPULATE_READ``,
            an unknown ``method``, or ``threads < 0``.
        BufferError: ``buf`` is not contiguous.
    """

def equal(a: Buffer, b: Buffer, threads: int = 0) -> bool:
    """True if the contiguous buffers ``a`` and ``b`` hold the same bytes.

    Buffers of different sizes are never equal. The comparison is a parallel ``memcmp``
    by chunks that stops early once a difference is found.

    Raises:
        BufferError: a buffer is not contiguous.
        ValueError: ``threads < 0``.
    """

def address(buf: Buffer) -> int:
    """The address of the first byte of ``buf`` (its ``Py_buffer.buf``).

    Used for provenance lookups: which cached mapping a storage lies in. Any buffer
    layout is accepted; the buffer is released before returning, so the address is only
    meaningful while the caller keeps the exporting object alive.
    """
