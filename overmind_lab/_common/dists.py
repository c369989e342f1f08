"""Installed distributions' versions from the names of their metadata folders along
``sys.path`` (Note [Versions without METADATA]); the loading process's keys and the daemon's
check of a saved entry's versions both read them."""

from __future__ import annotations

import os
import re
import sys

__all__ = ["canonical", "dist_info_versions", "version_of"]


def canonical(name: str) -> str:
    """A distribution's name as its ``.dist-info`` folder and ``pip`` compare it."""
    fast = name.replace("-", "_").replace(".", "_").lower()  # no regex: ~150 per process
    return fast if "__" not in fast else re.sub(r"[-_.]+", "_", name).lower()


def dist_info_versions() -> dict[str, str]:
    """Installed distributions by canonical name -> version from their ``.dist-info`` folder name,
    first along ``sys.path``; ``""`` for ``.egg-info`` (ask importlib).

    Note [Versions without METADATA]: ``importlib.metadata.version`` parses METADATA with the email
    parser (torch's ~50 KB): 15-25 ms, a third of a warm UNet load in a fresh kernel, and the import
    of ``importlib.metadata`` alone 17 ms of a daemon's start. The folder's name holds the same
    version (wheel spec), so only directory listings are read.
    """
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith("-info"):
                continue
            stem, _, suffix = name.rpartition(".")
            if suffix in ("dist-info", "egg-info"):
                project, _, version = stem.partition("-")
                found.setdefault(canonical(project), version if suffix == "dist-info" else "")
    return found


def version_of(name: str, found: dict[str, str]) -> str | None:
    """The installed version of distribution ``name`` (``found``: ``dist_info_versions()``), or
    ``None`` where none is installed; an egg's from its metadata (``importlib.metadata``)."""
    version = found.get(canonical(name))
    if version is None:
        return None
    if version:
        return version
    from importlib import metadata

    try:
        return metadata.version(name.replace("_", "-"))
    except (metadata.PackageNotFoundError, ValueError):
        return None
