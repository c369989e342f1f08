"""Cache keys: a key changes whenever the result of a call could change.

A key hashes the callable really called (``module.Class.method`` of the class it was looked up on),
every argument bound to the signature and normalized (paths resolved, objects from the cache by
their key), a signature of the source (a directory's files, a file, a hub revision), the versions,
the user's own loader code (``user_code.code_of``) and the process state the loaders read
(Note [What a warm hit skips]). An argument that cannot be normalized raises :class:`NotCacheable`:
the call runs uncached.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overmind_lab._common.dists import dist_info_versions, version_of
from overmind_lab._errors import NotCacheable
from overmind_lab._loading import deferred, user_code

if TYPE_CHECKING:
    from overmind_lab._common.messages import ReplaySpec

__all__ = ["KeyInfo", "make_key", "key_of", "remember", "FORMAT_VERSION"]

#: Bump when the stored layout changes: old entries then simply miss.
FORMAT_VERSION = 6
MAX_SOURCE_FILES = 20000
_SOURCE_PARAMS = ("pretrained_model_name_or_path", "pretrained_model_link_or_path",
                  "path", "model_path")


class KeyInfo:
    """A call's cache key and what else a store records of the call."""

    __slots__ = ("key", "name", "callable", "source", "call", "validate")

    # Not a ``@dataclass``: Note [A first call's imports] in ``load.py``.
    def __init__(self, key: str, name: str, callable: str, source: str | None,
                 call: ReplaySpec | None, validate: dict[str, Any] | None = None) -> None:
        self.key = key
        self.name = name
        self.callable = callable
        self.source = source
        self.call = call  # None when the call cannot be replayed
        #: what a restarted daemon checks before serving it: source signature, versions, python
        self.validate = validate

    def __repr__(self) -> str:
        return f"KeyInfo(key={self.key!r}, name={self.name!r}, callable={self.callable!r})"


# -- objects that came from the cache ---------------------------------------------------
_keys_by_id: dict[int, tuple[weakref.ref[Any], str]] = {}


def remember(obj: Any, key: str) -> None:
    """Record that ``obj`` came from the cache entry ``key`` (rebuilt, or stored from it)."""
    ident = id(obj)

    def forget(_ref: weakref.ref[Any]) -> None:
        _keys_by_id.pop(ident, None)

    try:
        ref = weakref.ref(obj, forget)
    except TypeError:  # dicts, lists: not weakly referenceable, not remembered
        return
    _keys_by_id[ident] = (ref, key)


def key_of(obj: Any) -> str | None:
    """The cache key of an object returned by a cached load, else ``None``."""
    found = _keys_by_id.get(id(obj))
    if found is not None and found[0]() is obj:
        return found[1]
    return None


# -- callables --------------------------------------------------------------------------
def callable_name(fn: Callable[..., Any]) -> tuple[str, str]:
    """(qualified name, import path ``module:qualname``) of what is really called."""
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type) and not inspect.ismodule(owner):
        raise NotCacheable(
            f"{fn!r} is bound to an instance; pass a function or a classmethod bound to "
            "a class (such as Model.from_pretrained)")
    func = getattr(fn, "__func__", fn)
    name = getattr(func, "__name__", None)
    if name is None:
        raise NotCacheable(f"{fn!r} has no name; pass a function or a classmethod")
    if isinstance(owner, type):
        qual = f"{owner.__module__}.{owner.__qualname__}.{name}"
        path = f"{owner.__module__}:{owner.__qualname__}.{name}"
    else:
        qual = f"{func.__module__}.{func.__qualname__}"
        path = f"{func.__module__}:{func.__qualname__}"
    return qual, path


def _code_identity(fn: Callable[..., Any]) -> Any:
    """Local functions and lambdas have no unique name: key them by their code."""
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None or "<" not in getattr(func, "__qualname__", ""):
        return None
    cells = [c.cell_contents for c in (func.__closure__ or ())]
    return {
        "file": code.co_filename, "line": code.co_firstlineno,
        "code": hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest(),
        "closure": [normalize(c, "<closure>") for c in cells],
    }


# -- arguments --------------------------------------------------------------------------
#: Nesting beyond this (or a cycle) makes an argument uncacheable rather than slow.
MAX_DEPTH = 32


def normalize(value: Any, where: str, _seen: tuple[int, ...] = ()) -> Any:
    """A JSON-able, canonical description of an argument value. Config-like objects (with
    ``to_dict``, dataclasses) enter by their complete state, not ``to_dict()``, which drops fields
    such as ``_attn_implementation_internal`` that change what gets built."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if len(_seen) > MAX_DEPTH or id(value) in _seen:
        raise NotCacheable(f"argument {where} is nested too deeply or refers to itself")
    seen = (*_seen, id(value))
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, os.PathLike):
        return {"path": _source_signature(os.fspath(value))}
    if isinstance(value, bytes):
        return {"bytes": hashlib.sha256(value).hexdigest()}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [normalize(v, where, seen) for v in value]}
    if isinstance(value, (set, frozenset)):
        items = [normalize(v, where, seen) for v in value]
        return {"set": sorted(items, key=lambda p: json.dumps(p, sort_keys=True))}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"dict": {k: normalize(value[k], f"{where}[{k!r}]", seen)
                             for k in sorted(value)}}
        pairs = [[normalize(k, f"{where} key", seen), normalize(v, f"{where}[{k!r}]", seen)]
                 for k, v in value.items()]  # e.g. id2label = {0: "negative", ...}
        return {"pairs": sorted(pairs, key=lambda p: json.dumps(p, sort_keys=True))}
    cached = key_of(value)
    if cached is not None:
        return {"cached": cached}
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"}
    if isinstance(value, type):
        return {"type": f"{value.__module__}.{value.__qualname__}"}
    torchy = _normalize_torch(value)
    if torchy is not None:
        return torchy
    if callable(getattr(value, "to_dict", None)) or dataclasses.is_dataclass(value):
        return {"object": f"{type(value).__module__}.{type(value).__qualname__}",
                "state": _complete_state(value, where, seen)}
    raise NotCacheable(
        f"argument {where} of type {type(value).__module__}.{type(value).__qualname__} "
        "cannot be part of a cache key (only plain values, paths, dtypes, devices, "
        "configs and objects loaded through the cache can)")


def _complete_state(value: Any, where: str, seen: tuple[int, ...]) -> Any:
    """Every attribute of a config-like object, canonical (see :func:`normalize`)."""
    state = getattr(value, "__dict__", None)
    if deferred.pending(value):
        deferred.complete(value)  # the state a plain load's object has
        state = value.__dict__
    if not isinstance(state, dict):
        raise NotCacheable(f"argument {where} of type {type(value).__qualname__} has no "
                           "attribute dictionary, so its state cannot be part of a cache key")
    out = {}
    for name in sorted(state):
        out[name] = normalize(state[name], f"{where}.{name}", seen)
    slots = [s for cls in type(value).__mro__ for s in getattr(cls, "__slots__", ())
             if s not in ("__dict__", "__weakref__")]
    for name in sorted(set(slots)):
        if hasattr(value, name):
            out[f"slot:{name}"] = normalize(getattr(value, name), f"{where}.{name}", seen)
    return out


def _normalize_torch(value: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    return None


# -- sources ----------------------------------------------------------------------------
def _source_signature(text: str) -> dict[str, Any]:
    path = Path(text).expanduser()
    try:
        exists = path.exists()
    except OSError:  # no path at all (ENAMETOOLONG: a text argument of 256+ characters)
        return {"text": text}
    if exists:
        resolved = path.resolve()
        return {"local": str(resolved), "files": _tree_signature(resolved)}
    return {"hub": text}


def _file_identity(st: os.stat_result) -> list[int]:
    """Note [File signatures]: (device, inode, size, mtime_ns, ctime_ns) of every file a load reads.
    The inode catches a file replaced by rename even with its mtime restored (``cp -p``, ``rsync
    -a``); size a truncation or append; mtime an ordinary write; ctime a write whose mtime was set
    back, a ``chmod``, a new hard link (user space cannot set a ctime).

    Two writes within one timestamp tick (a few ms before Linux 6.13) look like one, so a file
    written *while* its signature is taken can go unseen: the daemon checks the source again when
    the entry is stored (``source_changed`` in ``_daemon/persist.py``). An in-place write that keeps
    size, mtime and ctime needs root. A signature that cannot be taken raises ``NotCacheable`` or
    changes the key: a miss, never a stale hit.
    """
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _tree_signature(root: Path) -> Any:
    if root.is_file():
        return _file_identity(root.stat())
    out: list[Any] = []
    stack = [root]
    while stack:
        current = stack.pop()
        try:
            entries = sorted(os.scandir(current), key=lambda e: e.name)
        except OSError as exc:
            raise NotCacheable(f"cannot read model directory {current}: {exc}") from exc
        for entry in entries:
            if entry.name.startswith(".") and entry.name not in (".gitattributes",):
                continue
            if entry.is_dir():
                stack.append(Path(entry.path))
            else:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # dangling symlink: the loader ignores it too
                out.append([os.path.relpath(entry.path, root), *_file_identity(st)])
                if len(out) > MAX_SOURCE_FILES:
                    raise NotCacheable(f"{root} holds more than {MAX_SOURCE_FILES} files; "
                                       "pass the model directory itself")
    return out


def _hub_signature(repo_id: str, revision: Any) -> dict[str, Any]:
    """The snapshot a hub id resolves to in the local hub cache, if it is there."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return {"hub": repo_id, "revision": revision}
    rev = revision if isinstance(revision, str) else "main"
    for kind in ("models", "datasets", "spaces"):
        repo_dir = Path(HF_HUB_CACHE) / f"{kind}--{repo_id.replace('/', '--')}"
        if not repo_dir.is_dir():
            continue
        ref = repo_dir / "refs" / rev
        commit = ref.read_text().strip() if ref.is_file() else rev
        snapshot = repo_dir / "snapshots" / commit
        if snapshot.is_dir():
            return {"hub": repo_id, "commit": commit, "files": _tree_signature(snapshot)}
    return {"hub": repo_id, "revision": revision}


# Note [What a warm hit skips]: a hit returns what an earlier call built, so everything that call
# read that can change what it builds is in the key. Besides arguments and source files,
# the HF loaders read:
# - library versions (accelerate changes ``low_cpu_mem_usage``, peft adapters) -> _versions
# - torch's default dtype and device, the accelerators it sees (``device_map="auto"``), the
#   attention backends installed (they pick ``attn_implementation``)      -> _process_state
# - environment variables: ``DIFFUSERS_*``, ``TRANSFORMERS_*``, ``HF_*``, ``ACCELERATE_*``,
#   ``USE_*`` and the distributed ones (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), except those
#   that change only output or identity (``_ENV_IGNORED``: verbosity, progress, tokens)
# - the user's own code, which no version names: the loader (function, class, MRO) by a digest
#   of its file, or source or bytecode without one, for each part not from a regular
#   installed distribution (Note [Regular code] in ``user_code``)         -> user_code.code_of
# Handled otherwise: the user's classes in the result (their digests are in the entry; a hit with
# other code is a miss that replaces it: Note [Code that changed under an entry] in ``load``);
# everything else the cold load read or ran, observed while it ran: files and folders outside the
# source (a config folder passed by path, a hub cache's ``refs/main``), the user's modules it
# imported or that the result's modules import (a helper), installed distributions' ``RECORD``
# (Note [What a load depends on] in ``manifest``, checked on every hit as the classes are);
# random generators (a load that draws is not cached: Note [Loads that draw random numbers]);
# warnings and log records (replayed); side effects on arguments (not repeated); ``torch.backends``
# flags (they act when a model runs, not when it is built).
_VERSIONED = ("torch", "diffusers", "transformers", "accelerate", "safetensors",
              "huggingface_hub", "tokenizers", "peft")
_ENV_PREFIXES = ("DIFFUSERS_", "TRANSFORMERS_", "HF_", "ACCELERATE_", "USE_")
_ENV_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
_ENV_IGNORED = frozenset({
    "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY", "HF_HUB_VERBOSITY",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS", "HF_HUB_DISABLE_PROGRESS_BARS",
    "HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_IMPLICIT_TOKEN", "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN", "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT",
    "HF_HUB_DISABLE_SYMLINKS_WARNING", "HF_HUB_DISABLE_EXPERIMENTAL_WARNING",
})
_ATTENTION_PACKAGES = ("flash_attn", "flash_attn_interface", "kernels", "xformers", "sageattention")


def _versions(qualname: str) -> dict[str, str]:
    out = {"python": sys.version.split()[0], "format": str(FORMAT_VERSION), **_installed_versions()}
    top = qualname.split(".")[0]
    mod = sys.modules.get(top)
    if top not in out and mod is not None:
        out[top] = str(getattr(mod, "__version__", "?"))
    return out


@functools.lru_cache(maxsize=1)
def _installed_versions() -> dict[str, str]:
    # From installed metadata, not what is imported (a refresh worker must get the same key); once
    # per process, as its code does not change when a package is upgraded under it.
    found = dist_info_versions()
    out = {}
    for dist in _VERSIONED:
        version = version_of(dist, found)
        if version is not None:
            out[dist] = version
    return out


@functools.lru_cache(maxsize=1)
def _attention_packages() -> tuple[str, ...]:
    # Once per process: the libraries cache the same answer.
    return tuple(p for p in _ATTENTION_PACKAGES if importlib.util.find_spec(p) is not None)


def _torch_if_installed() -> Any:
    """torch, imported if installed. Loaders import it on the way where installed; keyed on whether
    it was imported, a process's first key would differ from its later ones."""
    torch = sys.modules.get("torch")
    if torch is None and _torch_installed():
        import torch
    return torch


@functools.lru_cache(maxsize=1)
def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _process_state() -> dict[str, Any]:
    """Inputs of the loaders that are neither arguments nor files (the Note above)."""
    env = {k: v for k, v in os.environ.items()
           if (k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES) and k not in _ENV_IGNORED}
    state: dict[str, Any] = {"env": env, "attention": list(_attention_packages())}
    torch = _torch_if_installed()
    if torch is not None:
        state["default_dtype"] = str(torch.get_default_dtype())
        state["default_device"] = str(torch.get_default_device())
        state["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        mps = getattr(torch.backends, "mps", None)
        state["mps"] = bool(mps is not None and mps.is_available())
    return state


#: the search path's state when the background thread scanned (Note [The first call's work,
#: earlier] in ``prewarm``), until the first key compares it
_prewarmed: tuple[Any, ...] | None = None


def prewarm() -> None:
    """The installation scans of a process's first key, ahead of it (in ``prewarm``'s thread)."""
    global _prewarmed
    state = site_state()  # before the scans: a change while they run is seen
    _installed_versions()
    _attention_packages()
    _torch_installed()
    user_code.prewarm()
    _prewarmed = state


def forget_prewarm() -> None:
    """Forget whatever scans the prewarm thread made (a fork's child of an unfinished thread)."""
    global _prewarmed
    _prewarmed = None
    for cached in (_installed_versions, _attention_packages, _torch_installed):
        cached.cache_clear()
    user_code.forget_roots()


def site_state() -> tuple[Any, ...]:
    """What the installation scans depend on (Note [The first call's work, earlier])."""
    mtimes: list[int | None] = []
    for entry in sys.path:
        try:
            mtimes.append(os.stat(entry or ".").st_mtime_ns)
        except OSError:
            mtimes.append(None)
    return tuple(sys.path), tuple(mtimes), tuple(sys.meta_path)


# Note [A finder added since the scans]: importing transformers (diffusers does) appends its
# ``_LegacyModuleAliasFinder`` to ``sys.meta_path``, so in the notebook order (the scans run beside
# the imports of torch and diffusers) the search path's state always differed at the first key and
# every scan was made again (~5 ms). Of the scans, only the ``find_spec`` answers (the attention
# packages, torch) go through ``sys.meta_path``; the ``.dist-info`` and editable-root scans read the
# folders on ``sys.path``. So where only finders were added (the path and its folders' ``mtime``
# as they were, no finder gone), each new finder is asked for the names those scans did not find;
# any answer, or a finder gone, empties those two caches, and the folder scans stay.
def _settle() -> None:
    """Forget the scans made ahead of the first key if the search path changed since."""
    global _prewarmed
    state, _prewarmed = _prewarmed, None
    if state is None:
        return
    now = site_state()
    if now[:2] != state[:2]:
        forget_prewarm()
        return
    if now[2] != state[2] and not _only_blind_finders_added(state[2], now[2]):
        _attention_packages.cache_clear()
        _torch_installed.cache_clear()


def _only_blind_finders_added(before: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    """Note [A finder added since the scans]: every finder of ``before`` still there, and none
    of the added ones finds a name the ``find_spec`` scans did not."""
    kept = {id(f) for f in now}
    if any(id(f) not in kept for f in before):
        return False
    had = {id(f) for f in before}
    missing = [p for p in _ATTENTION_PACKAGES if p not in _attention_packages()]
    if not _torch_installed():
        missing.append("torch")
    for finder in now:
        if id(finder) in had:
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            return False
        for name in missing:
            try:
                if find(name, None) is not None:
                    return False
            except Exception:  # noqa: BLE001 - a finder that fails cannot be trusted blind
                return False
    return True


# -- the key ----------------------------------------------------------------------------
def make_key(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> KeyInfo:
    if _prewarmed is not None:
        _settle()
    qual, import_path = callable_name(fn)
    try:
        sig = inspect.signature(fn)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise NotCacheable(f"cannot bind the arguments of {qual}: {exc}") from exc
    bound.apply_defaults()
    source_param = _source_param(sig)
    normalized: dict[str, Any] = {}
    source: str | None = None
    local_signature: dict[str, Any] | None = None
    for pname, value in bound.arguments.items():
        kind = sig.parameters[pname].kind
        if pname == source_param and isinstance(value, (str, os.PathLike)):
            source = os.fspath(value)
            sig_ = _source_signature(source)
            if "hub" in sig_:
                sig_ = _hub_signature(source, bound.arguments.get("revision"))
            # Note [The caller's own text]: the loaders record the argument as the caller wrote
            # it (``config._name_or_path``, a tokenizer's ``name_or_path``): a relative path, a
            # symlink, a trailing slash build another object than the resolved path, so the text
            # is keyed beside the signature of what it names.
            normalized[pname] = {"source": sig_, "text": source}
            if "local" in sig_:
                source = sig_["local"]
                local_signature = sig_
        elif kind is inspect.Parameter.VAR_KEYWORD:
            normalized[pname] = {k: normalize(v, k) for k, v in sorted(value.items())}
        else:
            normalized[pname] = normalize(value, pname)
    versions = _versions(qual)
    material = {"callable": qual, "code": _code_identity(fn), "args": normalized,
                "versions": versions, "process": _process_state(),
                "user_code": user_code.code_of(fn)}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return KeyInfo(key=digest[:32], name=_display_name(qual, bound, source_param),
                   callable=qual, source=source,
                   call=_replay_spec(import_path, args, kwargs),
                   validate={"source": local_signature, "versions": versions,
                             "python": sys.executable})


def _source_param(sig: inspect.Signature) -> str | None:
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for p in params:
        if p.name in _SOURCE_PARAMS:
            return p.name
    return params[0].name if params else None


def _display_name(qual: str, bound: inspect.BoundArguments, source_param: str | None) -> str:
    parts = qual.split(".")
    short = ".".join(parts[-2:]) if len(parts) >= 2 else qual
    shown = []
    if source_param is not None and source_param in bound.arguments:
        value = bound.arguments[source_param]
        text = os.fspath(value) if isinstance(value, os.PathLike) else value
        shown.append(repr(text) if not isinstance(text, str) or len(text) < 120 else repr(
            "…" + text[-100:]))
    extra = {**bound.arguments, **next((v for p, v in bound.arguments.items()
                                        if bound.signature.parameters[p].kind
                                        is inspect.Parameter.VAR_KEYWORD), {})}
    if isinstance(extra.get("subfolder"), str) and extra["subfolder"]:
        shown.append(f"subfolder={extra['subfolder']!r}")
    return f"{short}({', '.join(shown)})"


def describe(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The display name of a call, for calls that get no key (never raises)."""
    try:
        qual, _ = callable_name(fn)
        sig = inspect.signature(fn)
        bound = sig.bind(*args, **kwargs)
    except (NotCacheable, TypeError, ValueError):
        return str(getattr(fn, "__qualname__", repr(fn)))
    return _display_name(qual, bound, _source_param(sig))


# Note [Replay]: a refresh re-runs the recorded call in a fresh interpreter. Only calls whose
# arguments survive a JSON round trip (plus dtypes) can be replayed.
def _replay_spec(import_path: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> ReplaySpec | None:
    if "<" in import_path:
        return None
    try:
        return {"callable": import_path, "args": [_replayable(a) for a in args],
                "kwargs": {k: _replayable(v) for k, v in kwargs.items()},
                "python": sys.executable, "sys_path": [p for p in sys.path if p],
                "cwd": os.getcwd()}
    except NotCacheable:
        return None


def _replayable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_replayable(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _replayable(v) for k, v in value.items()}
    torchy = _normalize_torch(value)
    if torchy is not None:
        return {"__torch__": torchy}
    raise NotCacheable("not replayable")


def revive(value: Any) -> Any:
    """Inverse of the replay encoding (used by the refresh worker)."""
    if isinstance(value, list):
        return [revive(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__torch__"}:
            import torch

            spec = value["__torch__"]
            if "dtype" in spec:
                return getattr(torch, spec["dtype"].removeprefix("torch."))
            return torch.device(spec["device"])
        return {k: revive(v) for k, v in value.items()}
    return value
