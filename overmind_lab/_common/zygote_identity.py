"""What names a zygote, computed with nothing but ``os`` and ``sys``: its identity (a hash of the
interpreter, its environment and the :data:`IMPORT_ENV_PREFIXES` variables) and, where that is
certain without ``tempfile``, the folder of its socket. ``zygote_paths`` builds on these;
``overmind-lab run`` uses them before it imports anything (Note [A plain run at once] in
``_launcher/run.py``).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["IMPORT_ENV_PREFIXES", "NOT_IMPORT_ENV", "ZYGOTE_IDLE_ENV", "ZYGOTE_BOOT_WAIT_ENV",
           "ZYGOTE_PACKAGE_CHECK_ENV", "TIMELINE_ENV", "import_env", "environment", "identity",
           "runtime_dir_at_once", "socket_folder_at_once", "SOCKET_ENV", "DAEMON_SOCKET",
           "daemon_socket_at_once", "RESTART_STANDBY_ENV"]

#: Environment variables (by prefix) that can change what an import does or which threads and
#: devices it sets up: kernels whose values differ never share a zygote.
IMPORT_ENV_PREFIXES = (
    "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_",
    "BLIS_", "VECLIB_", "NUMEXPR_", "PYTHON", "LD_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_",
    "DIFFUSERS_", "TORCH", "PYTORCH_", "TOKENIZERS_", "XLA_", "TF_", "JAX_", "VIRTUAL_ENV",
    "CONDA_PREFIX", "HOME", "XDG_CACHE_HOME", "OVERMIND_LAB_",
    # the locale at interpreter start fixes the UTF-8 mode and the file system encoding
    "LANG", "LC_",
)

#: The daemon's socket: ``$OVERMIND_LAB_SOCKET``, else ``DAEMON_SOCKET`` in the runtime folder
#: (``naming.socket_path``, :func:`daemon_socket_at_once`).
SOCKET_ENV = "OVERMIND_LAB_SOCKET"
DAEMON_SOCKET = "daemon.sock"

#: Settings of the zygote's own life, not of what imports do (read in ``zygote_paths``): never
#: part of the identity.
ZYGOTE_IDLE_ENV = "OVERMIND_LAB_ZYGOTE_IDLE"
ZYGOTE_BOOT_WAIT_ENV = "OVERMIND_LAB_ZYGOTE_BOOT_WAIT"
ZYGOTE_PACKAGE_CHECK_ENV = "OVERMIND_LAB_ZYGOTE_PACKAGE_CHECK"
TIMELINE_ENV = "OVERMIND_LAB_TIMELINE"
#: How long a launcher's restart standby waits for its claim (``_forked/claim.py``).
RESTART_STANDBY_ENV = "OVERMIND_LAB_RESTART_STANDBY_SECONDS"
NOT_IMPORT_ENV = frozenset({ZYGOTE_IDLE_ENV, ZYGOTE_BOOT_WAIT_ENV, ZYGOTE_PACKAGE_CHECK_ENV,
                            TIMELINE_ENV, RESTART_STANDBY_ENV})


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` that matters to imports."""
    return {k: v for k, v in sorted(env.items())
            if k.startswith(IMPORT_ENV_PREFIXES) and k not in NOT_IMPORT_ENV}


def environment(interpreter: str) -> str:
    """The Python environment ``interpreter`` runs in: its venv's directory, else its prefix.

    Note [Environments share an interpreter]: venvs resolve to one executable, but a kernel of
    one must never fork from another's zygote: the venv is found from the path as given (the
    folder above ``bin/`` with ``pyvenv.cfg``). More in docs/notes.md."""
    path = os.path.abspath(interpreter)
    venv = os.path.dirname(os.path.dirname(path))
    if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        return os.path.realpath(venv)
    return os.path.dirname(os.path.dirname(os.path.realpath(path)))


def _sha256(data: bytes) -> str:
    # The interpreter's own SHA-256 (a built-in module) where it has one: ``hashlib`` loads
    # OpenSSL (2-4 ms), a third of what ``overmind-lab run`` may spend before a plain exec.
    try:
        from _sha2 import sha256  # type: ignore[import-not-found]  # 3.12+
    except ImportError:
        try:
            from _sha256 import sha256  # type: ignore[import-not-found]  # 3.10, 3.11
        except ImportError:  # a build without the built-in hashes
            from hashlib import sha256
    return str(sha256(data).hexdigest())


def identity(interpreter: str, env: Mapping[str, str]) -> str:
    """A short hash of the interpreter, its environment and the import-relevant variables (NUL
    separates the parts: no path, version or variable holds one)."""
    parts = [os.path.realpath(interpreter), environment(interpreter), sys.version,
             *(f"{k}={v}" for k, v in import_env(env).items())]
    return _sha256("\0".join(parts).encode("utf-8", "surrogateescape"))[:16]


def runtime_dir_at_once(env: Mapping[str, str]) -> str | None:
    """The per-user runtime folder (``naming.runtime_dir``) where it is certain without
    ``tempfile``: ``$XDG_RUNTIME_DIR/overmind-lab``, or ``/tmp/overmind-lab-<uid>`` when no
    ``TMPDIR``, ``TEMP`` or ``TMP`` is set (``tempfile.gettempdir``'s first choice then); else
    ``None``."""
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return os.path.join(xdg, "overmind-lab")
    if any(env.get(k) for k in ("TMPDIR", "TEMP", "TMP")):
        return None
    if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK | os.X_OK):
        return f"/tmp/overmind-lab-{os.getuid()}"
    return None


def daemon_socket_at_once(env: Mapping[str, str]) -> str | None:
    """``naming.socket_path()`` where it is certain without ``pathlib`` or ``tempfile``:
    ``$OVERMIND_LAB_SOCKET`` as given, else ``DAEMON_SOCKET`` in :func:`runtime_dir_at_once`;
    ``None`` when not certain."""
    override = env.get(SOCKET_ENV)
    if override:
        return override
    folder = runtime_dir_at_once(env)
    return None if folder is None else os.path.join(folder, DAEMON_SOCKET)


def socket_folder_at_once(env: Mapping[str, str]) -> str | None:
    """``zygote_paths.zygote_dir(env)`` where it is certain without ``pathlib`` or ``tempfile``:
    the folder of ``$OVERMIND_LAB_SOCKET`` when that is absolute and plain (no ``.`` or ``..``
    part), else :func:`runtime_dir_at_once`; ``None`` when not certain."""
    override = env.get(SOCKET_ENV)
    if not override:
        return runtime_dir_at_once(env)
    parts = override.split("/")
    if not override.startswith("/") or "." in parts or ".." in parts:
        return None
    return "/" + "/".join(p for p in parts[:-1] if p) if parts[-1] else None
