"""The zygote through the REST API of the server extension: a real Jupyter server
(``pytest-jupyter``) and a real zygote (with a one-module preload set, to boot fast)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPResponse

from overmind_lab._common import zygote_client as zygote_mod
from overmind_lab._common.zygote_paths import ZygotePaths
from tests.test_warm_kernel import _kill_ours, ready_zygote

pytest_plugins = ["pytest_jupyter.jupyter_server"]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

API = "overmind-lab/api/v1"
Fetch = Callable[..., Awaitable[HTTPResponse]]


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"overmind_lab._jupyter_server": True},
                          "reraise_server_extension_failures": True}}


@pytest.fixture
def zygote(sock_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setenv("OVERMIND_LAB_PRELOAD", "threadpoolctl")
    env = dict(os.environ)
    try:
        zygote_mod.spawn(ZygotePaths.for_launch(sys.executable, env), owners=[os.getpid()],
                         env=env)
        yield ready_zygote(sock_path.parent, timeout=120)
    finally:
        _kill_ours(str(sock_path.parent))


async def test_the_zygote_is_listed_and_restarted_through_rest(
        zygote: dict[str, Any], jp_fetch: Fetch, sock_path: Path) -> None:
    listed = json.loads((await jp_fetch(API, "zygotes")).body)["zygotes"]
    assert [z["pid"] for z in listed] == [zygote["pid"]]
    z = listed[0]
    assert z["python"] == sys.executable and z["forks"] == 0 and z["refusal"] is None
    assert "threadpoolctl" in z["preload_roots"] and z["pss_bytes"] > 0
    response = await jp_fetch(API, "zygotes", "restart", method="POST", body=b"")
    assert json.loads(response.body) == {"restarted": [zygote["pid"]]}
    fresh = ready_zygote(sock_path.parent, not_pid=zygote["pid"], timeout=120)
    listed = json.loads((await jp_fetch(API, "zygotes")).body)["zygotes"]
    assert [z["pid"] for z in listed] == [fresh["pid"]]
