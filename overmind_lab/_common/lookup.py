"""How a user's word names cache entries: one rule for the daemon and the REST handler."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["match_keys"]


def match_keys(query: str, entries: Iterable[tuple[str, str]]) -> list[str]:
    """The keys ``query`` names among ``(key, display name)`` pairs: an exact key, else the keys
    it prefixes, else the exact names. More than one match: the caller decides."""
    pairs = list(entries)
    if any(key == query for key, _ in pairs):
        return [query]
    matches = [key for key, _ in pairs if key.startswith(query)]
    if not matches:
        matches = [key for key, name in pairs if name == query]
    return matches
