"""Optional dependencies: which extra brings what, and one clear error when one is missing
(before anything starts).

Note [Extras]: :data:`EXTRAS` names, for each extra of ``pyproject.toml``, the modules a feature
of that extra imports; keep the two in step.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from overmind_lab._errors import OvermindError

__all__ = ["EXTRAS", "MissingDependency", "missing", "require", "require_one"]

#: The import names each extra provides (what the features of that extra import).
EXTRAS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "diffusers": ("torch", "diffusers", "transformers", "safetensors"),
    "transformers": ("torch", "transformers", "safetensors"),
    "jupyter": ("IPython", "ipykernel", "ipywidgets", "jupyter_client", "jupyter_server",
                "jupyterlab", "threadpoolctl"),
    "bench": ("torch", "diffusers", "transformers", "safetensors", "matplotlib", "websocket",
              "jupyter_client", "jupyter_server", "ipykernel"),
}


class MissingDependency(OvermindError, ModuleNotFoundError):
    """A feature needs an optional dependency that is not installed; the message names the extra
    (``pip install "overmind-lab[torch]"``). ``name`` is the first missing module."""


def missing(modules: Sequence[str]) -> list[str]:
    """The top-level modules of ``modules`` that cannot be imported here (not imported)."""
    out = []
    for name in modules:
        top = name.partition(".")[0]
        if top in sys.modules:
            continue
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(top)
    return out


def require(extra: str, feature: str, modules: Sequence[str] | None = None) -> None:
    """Raise :class:`MissingDependency` unless ``modules`` (default: the extra's) import;
    ``feature`` names what needs them, as the user called it (``"overmind_lab.load()"``)."""
    absent = missing(EXTRAS[extra] if modules is None else modules)
    if absent:
        what = absent[0] if len(absent) == 1 else ", ".join(absent[:-1]) + " and " + absent[-1]
        verb = "is" if len(absent) == 1 else "are"
        raise MissingDependency(
            f"{feature} needs {what}, which {verb} not installed here: "
            f'pip install "overmind-lab[{extra}]"', name=absent[0])


def require_one(libraries: Sequence[str], feature: str) -> None:
    """Raise :class:`MissingDependency` unless one of ``libraries`` imports, each the library of
    the extra of its name (``"diffusers"``, ``"transformers"``); none given, none is needed.
    ``feature`` as for :func:`require` (``"overmind_lab.patch_all()"``)."""
    absent = missing(libraries)
    if not libraries or len(absent) < len(libraries):
        return
    if len(libraries) == 1:
        require(libraries[0], feature, libraries)
    what = ", ".join(libraries[:-1]) + " or " + libraries[-1]
    which = "neither of which" if len(libraries) == 2 else "none of which"
    installs = " or ".join(f'"overmind-lab[{name}]"' for name in libraries)
    raise MissingDependency(f"{feature} needs {what}, {which} is installed here: "
                            f"pip install {installs}", name=libraries[0])
