"""Jupyter server extension: the REST API behind the JupyterLab sidebar (``handlers``, talking
to the daemon through :class:`overmind_lab.Client`) and the kernel transport's tuning
(``transport``: Note [Kernel messages without delays]). Importing it is cheap: the handlers (and
tornado) are imported only when a server loads the extension.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "_jupyter_labextension_paths",
    "_jupyter_server_extension_points",
    "_load_jupyter_server_extension",
]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "overmind_lab._jupyter_server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    # ``src`` is relative to ``overmind_lab``, which re-exports this: its ``labextension`` folder.
    return [{"src": "labextension", "dest": "overmind-lab"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from overmind_lab._jupyter_server.handlers import setup_handlers
    from overmind_lab._jupyter_server.transport import tune_kernel_transport

    setup_handlers(serverapp)
    tuned = tune_kernel_transport(serverapp)  # Note [Kernel messages without delays]
    serverapp.log.info(
        "overmind-lab server extension loaded: %s%s",
        serverapp.web_app.settings["overmind_lab"].api_root,
        "".join(f"; {what}" for what in tuned),
    )

