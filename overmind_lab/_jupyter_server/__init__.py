"""Jupyter server extension: the REST API behind the JupyterLab sidebar.

Routes live under ``<base_url>/overmind-lab/api/v1/`` (see ``handlers``); each one talks
to the per-user daemon through :class:`overmind_lab.Client`. The extension is enabled by
``jupyter-config/jupyter_server_config.d/overmind_lab.json``, installed with the package;
by hand::

    jupyter server extension enable overmind_lab._jupyter_server

Importing this module is cheap: no tornado, no torch. ``jupyter server extension list``
and ``jupyter labextension`` import it through ``overmind_lab`` for the two discovery
functions below; the handlers are imported only when a server loads the extension.
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
    # ``src`` is relative to the package that exposes this function: ``overmind_lab``
    # re-exports it, so it names ``overmind_lab/labextension`` (the build output of
    # package.json's ``jupyterlab.outputDir``).
    return [{"src": "labextension", "dest": "overmind-lab"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from overmind_lab._jupyter_server.handlers import setup_handlers

    setup_handlers(serverapp)
    serverapp.log.info(
        "overmind-lab server extension loaded: %s",
        serverapp.web_app.settings["overmind_lab"].api_root,
    )

