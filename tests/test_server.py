"""The Jupyter server extension's REST API, against a real Jupyter server and a real daemon.

The server runs in this process (``pytest-jupyter``) under a non-root base URL
(``/a%40b/``); the daemon is a real one on a temporary socket (``sock_path`` / ``daemon``
from conftest); entries are real tiny diffusers models stored by real child processes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from jupyter_server.utils import url_path_join
from tornado.httpclient import HTTPClientError, HTTPResponse

from overmind_lab import Client
from overmind_lab._jupyter_server import (
    _jupyter_labextension_paths,
    _jupyter_server_extension_points,
)
from tests.conftest import last_json, run_py, save_tiny_unet

pytest_plugins = ["pytest_jupyter.jupyter_server"]

API = "overmind-lab/api/v1"
Fetch = Callable[..., Awaitable[HTTPResponse]]

# A child process that loads a model directory through the cache and prints its key.
LOAD_UNET = """
import json, overmind_lab
from diffusers import UNet2DConditionModel
with overmind_lab.record_loads() as events:
    overmind_lab.load(UNet2DConditionModel.from_pretrained, {path!r})
print(json.dumps({{"key": events[-1].key, "outcome": events[-1].outcome}}))
"""

ENTRY_FIELDS = {
    "key", "name", "class", "callable", "source", "bytes", "shared_bytes", "tensors",
    "created", "last_used", "hits", "cold_seconds", "store_seconds", "warm_seconds",
    "holders", "replayable", "refresh",
}
STATUS_FIELDS = {
    "running", "pid", "socket", "version", "started", "uptime_seconds", "budget_bytes",
    "cached_bytes", "evicted_mapped_bytes", "entries", "memory_total_bytes",
    "memory_available_bytes",
}


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {
        "ServerApp": {
            "jpserver_extensions": {"overmind_lab._jupyter_server": True},
            "reraise_server_extension_failures": True,
        }
    }


def load_unet(path: Path) -> dict[str, Any]:
    """Load ``path`` through the cache in a fresh process; ``{"key", "outcome"}``."""
    return dict(last_json(run_py(LOAD_UNET.format(path=str(path)))))


@pytest.fixture
def unet_dir(tmp_path: Path) -> Path:
    return save_tiny_unet(tmp_path / "unet")


@pytest.fixture
def cached_tensor(daemon: Client) -> str:
    """Key of a small tensor stored by this process (cheap: no child, no diffusers)."""
    import overmind_lab
    from tests.loaders import sized_load

    with overmind_lab.record_loads() as events:
        overmind_lab.load(sized_load, 4096, "server-test")
    assert events[-1].outcome == "cold"
    return str(events[-1].key)


@pytest.fixture
def cached_unet(daemon: Client, unet_dir: Path) -> str:
    """Key of a tiny UNet stored in the daemon by another process."""
    loaded = load_unet(unet_dir)
    assert loaded["outcome"] == "cold"
    return str(loaded["key"])


async def get_json(jp_fetch: Fetch, *parts: str, **kwargs: Any) -> Any:
    response = await jp_fetch(API, *parts, **kwargs)
    assert response.headers["Content-Type"].startswith("application/json")
    return json.loads(response.body)


async def post_json(jp_fetch: Fetch, *parts: str) -> tuple[int, Any]:
    response = await jp_fetch(API, *parts, method="POST", body=b"")
    return response.code, json.loads(response.body)


async def error_of(request: Awaitable[HTTPResponse]) -> tuple[int, dict[str, Any]]:
    with pytest.raises(HTTPClientError) as info:
        await request
    response = info.value.response
    assert response is not None
    assert response.headers["Content-Type"].startswith("application/json")
    return info.value.code, json.loads(response.body)


# -- discovery --------------------------------------------------------------------------
def test_discovery_functions_name_this_package() -> None:
    assert _jupyter_server_extension_points() == [{"module": "overmind_lab._jupyter_server"}]
    assert _jupyter_labextension_paths() == [{"src": "labextension", "dest": "overmind-lab"}]
    import overmind_lab

    assert overmind_lab._jupyter_server_extension_points() == [  # type: ignore[attr-defined]
        {"module": "overmind_lab._jupyter_server"}
    ]


def test_config_file_enables_the_extension() -> None:
    config = Path(__file__).parents[1] / "jupyter-config/jupyter_server_config.d/overmind_lab.json"
    data = json.loads(config.read_text())
    assert data == {"ServerApp": {"jpserver_extensions": {"overmind_lab._jupyter_server": True}}}


def test_importing_the_extension_module_is_cheap() -> None:
    proc = run_py("""
        import sys, json, overmind_lab._jupyter_server
        print(json.dumps(sorted(m for m in ("torch", "tornado", "jupyter_server", "diffusers")
                                if m in sys.modules)))
    """)
    assert last_json(proc) == []


async def test_extension_is_loaded(jp_serverapp: Any) -> None:
    extension = jp_serverapp.extension_manager.extensions["overmind_lab._jupyter_server"]
    assert extension.enabled
    settings = jp_serverapp.web_app.settings["overmind_lab"]
    assert settings.api_root == "/a%40b/overmind-lab/api/v1"


# -- status ------------------------------------------------------------------------------
async def test_status_with_the_daemon_running(daemon: Client, jp_fetch: Fetch) -> None:
    status = await get_json(jp_fetch, "status")
    assert STATUS_FIELDS <= status.keys()
    assert status["running"] is True
    assert status["pid"] == daemon.status()["pid"]
    assert status["socket"] == str(daemon.path)
    assert status["entries"] == 0 and status["cached_bytes"] == 0
    assert status["memory_total_bytes"] >= status["memory_available_bytes"] > 0


async def test_status_with_the_daemon_down_is_not_an_error(
        sock_path: Path, jp_fetch: Fetch) -> None:
    response = await jp_fetch(API, "status")
    assert response.code == 200
    status = json.loads(response.body)
    assert status["running"] is False
    assert status["socket"] == str(sock_path)
    assert status["memory_total_bytes"] >= status["memory_available_bytes"] > 0
    # Asking for the status must not start a daemon.
    assert Client(sock_path).status()["running"] is False


async def test_configured_socket_wins_over_the_environment(
        daemon: Client, jp_serverapp: Any, jp_fetch: Fetch,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERMIND_LAB_SOCKET", "/tmp/overmind-lab-no-such-dir/d.sock")
    assert (await get_json(jp_fetch, "status"))["running"] is False
    # c.OvermindLab.socket_path = ... (set on the live configurable)
    jp_serverapp.web_app.settings["overmind_lab"].socket_path = str(daemon.path)
    status = await get_json(jp_fetch, "status")
    assert status["running"] is True and status["socket"] == str(daemon.path)


# -- entries -----------------------------------------------------------------------------
async def test_entries_with_the_daemon_down_are_empty(sock_path: Path, jp_fetch: Fetch) -> None:
    assert await get_json(jp_fetch, "entries") == {"entries": []}
    assert Client(sock_path).status()["running"] is False


@pytest.mark.slow
async def test_entries_list_what_the_daemon_holds_with_timings(
        daemon: Client, cached_unet: str, unet_dir: Path, jp_fetch: Fetch) -> None:
    listed = (await get_json(jp_fetch, "entries"))["entries"]
    assert [e["key"] for e in listed] == [cached_unet]
    entry = listed[0]
    assert ENTRY_FIELDS <= entry.keys()
    assert entry == daemon.entries()[0] | {"holders": entry["holders"]}
    assert entry["class"].endswith("UNet2DConditionModel")
    assert entry["source"] == str(unet_dir.resolve())
    assert entry["bytes"] > 0 and entry["tensors"] > 0
    assert entry["cold_seconds"] > 0 and entry["replayable"] is True

    status = await get_json(jp_fetch, "status")
    assert status["entries"] == 1 and status["cached_bytes"] >= entry["bytes"]

    # A warm load in another process shows up as a hit with its time.
    assert load_unet(unet_dir) == {"key": cached_unet, "outcome": "warm"}
    entry = await get_json(jp_fetch, "entries", cached_unet)
    assert entry["hits"] == 1
    assert len(entry["warm_seconds"]) == 1 and entry["warm_seconds"][0] > 0


async def test_one_entry_by_key_or_unique_prefix(
        daemon: Client, cached_tensor: str, jp_fetch: Fetch) -> None:
    assert (await get_json(jp_fetch, "entries", cached_tensor))["key"] == cached_tensor
    assert (await get_json(jp_fetch, "entries", cached_tensor[:10]))["key"] == cached_tensor


async def test_many_entries_are_listed_in_one_call(daemon: Client, jp_fetch: Fetch) -> None:
    run_py("""
        import overmind_lab
        from tests.loaders import sized_load
        for i in range(100):
            overmind_lab.load(sized_load, 4096, f"entry-{i}")
    """, env={"PYTHONPATH": str(Path(__file__).parents[1])})
    daemon_pid = int(daemon.status()["pid"])
    started = _cpu_seconds(daemon_pid) + time.process_time()
    listed = (await get_json(jp_fetch, "entries"))["entries"]
    seconds = _cpu_seconds(daemon_pid) + time.process_time() - started
    assert len(listed) == 100
    # The 50 ms target is measured by the benchmark; this only catches per-entry work. CPU
    # seconds (the daemon's and this process's, where the server runs), not wall-clock
    # ones: a loaded machine stretches the latter, not the former.
    assert seconds < 2.0, f"GET entries took {seconds:.3f} CPU s for 100 entries"


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- evict -------------------------------------------------------------------------------
@pytest.mark.slow
async def test_evict_removes_the_entry_from_the_daemon(
        daemon: Client, cached_unet: str, jp_fetch: Fetch) -> None:
    code, body = await post_json(jp_fetch, "entries", cached_unet, "evict")
    assert code == 200 and body == {"evicted": [cached_unet]}
    assert daemon.entries() == []
    assert await get_json(jp_fetch, "entries") == {"entries": []}


async def test_evict_all(daemon: Client, cached_tensor: str, jp_fetch: Fetch) -> None:
    import overmind_lab
    from tests.loaders import sized_load

    overmind_lab.load(sized_load, 8192, "another")
    assert len(daemon.entries()) == 2
    code, body = await post_json(jp_fetch, "evict-all")
    assert code == 200 and len(body["evicted"]) == 2 and cached_tensor in body["evicted"]
    assert daemon.entries() == []


async def test_evict_all_with_nothing_cached(daemon: Client, jp_fetch: Fetch) -> None:
    assert await post_json(jp_fetch, "evict-all") == (200, {"evicted": []})


async def test_evict_with_the_daemon_down_is_a_json_503(sock_path: Path, jp_fetch: Fetch) -> None:
    code, body = await error_of(jp_fetch(API, "entries", "abc", "evict", method="POST", body=b""))
    assert code == 503
    assert body["kind"] == "daemon_unavailable"
    assert str(sock_path) in body["message"]


# -- refresh -----------------------------------------------------------------------------
def wait_for(predicate: Callable[[], Any], timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out waiting for the daemon")


@pytest.mark.slow
@pytest.mark.usefixtures("resaves_refreshed")
async def test_refresh_of_a_changed_directory_gives_a_new_entry(
        daemon: Client, cached_unet: str, unet_dir: Path, jp_fetch: Fetch) -> None:
    save_tiny_unet(unet_dir, seed=7)  # the model on disk changes
    code, body = await post_json(jp_fetch, "entries", cached_unet, "refresh")
    assert code == 202
    assert body["entry"]["key"] == cached_unet
    assert body["entry"]["refresh"]["state"] in {"running", "done"}

    def refreshed() -> list[dict[str, Any]]:
        entries = daemon.entries()
        return [e for e in entries if e["refresh"]["state"] in {"done", "failed"}]

    (fresh,) = wait_for(refreshed)
    assert fresh["refresh"]["state"] == "done", fresh["refresh"]
    assert fresh["key"] != cached_unet
    assert [e["key"] for e in daemon.entries()] == [fresh["key"]]
    # The REST view agrees, and a later load of the directory is warm on the new entry.
    assert [e["key"] for e in (await get_json(jp_fetch, "entries"))["entries"]] == [fresh["key"]]
    assert load_unet(unet_dir) == {"key": fresh["key"], "outcome": "warm"}


async def test_refresh_of_an_unchanged_source_keeps_the_key(
        daemon: Client, cached_tensor: str, jp_fetch: Fetch) -> None:
    code, _ = await post_json(jp_fetch, "entries", cached_tensor, "refresh")
    assert code == 202

    def done() -> dict[str, Any] | None:
        entry = next(iter(daemon.entries()), None)
        return entry if entry and entry["refresh"]["state"] in {"done", "failed"} else None

    entry = wait_for(done)
    assert entry["key"] == cached_tensor
    assert entry["refresh"]["state"] == "done", entry["refresh"]


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "parts"),
    [
        ("GET", ("entries", "feedface")),
        ("POST", ("entries", "feedface", "evict")),
        ("POST", ("entries", "feedface", "refresh")),
        ("POST", ("entries", "not-a-key", "evict")),
    ],
)
async def test_unknown_entries_are_a_json_404(
        daemon: Client, cached_tensor: str, jp_fetch: Fetch, method: str,
        parts: tuple[str, ...]) -> None:
    kwargs: dict[str, Any] = {"method": method}
    if method == "POST":
        kwargs["body"] = b""
    code, body = await error_of(jp_fetch(API, *parts, **kwargs))
    assert code == 404
    assert body["kind"] == "unknown_entry"
    assert parts[1] in body["message"]
    assert [e["key"] for e in daemon.entries()] == [cached_tensor]  # nothing else happened


# -- daemon ------------------------------------------------------------------------------
async def test_start_the_daemon(sock_path: Path, jp_fetch: Fetch) -> None:
    assert Client(sock_path).status()["running"] is False
    code, status = await post_json(jp_fetch, "daemon", "start")
    assert code == 200
    assert status["running"] is True and status["pid"] > 0
    assert status["memory_total_bytes"] > 0
    assert Client(sock_path).status()["pid"] == status["pid"]
    # Starting again is harmless: the same daemon answers.
    _, again = await post_json(jp_fetch, "daemon", "start")
    assert again["pid"] == status["pid"]


# -- authentication and activity ---------------------------------------------------------
ROUTES = [
    ("GET", "status"),
    ("GET", "entries"),
    ("GET", "entries/feedface"),
    ("POST", "entries/feedface/evict"),
    ("POST", "entries/feedface/refresh"),
    ("POST", "evict-all"),
    ("POST", "daemon/start"),
    ("GET", "zygotes"),
    ("POST", "zygotes/restart"),
]


@pytest.mark.parametrize(("method", "route"), ROUTES)
@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_every_route_requires_authentication(
        daemon: Client, cached_tensor: str, http_server_client: Any, jp_base_url: str,
        method: str, route: str, token: str | None) -> None:
    headers = {"Authorization": f"token {token}"} if token else {}
    response = await http_server_client.fetch(
        url_path_join(jp_base_url, API, route), method=method,
        body=b"" if method == "POST" else None, headers=headers, raise_error=False)
    assert response.code == 403
    assert [e["key"] for e in daemon.entries()] == [cached_tensor]  # nothing was evicted


async def test_polling_does_not_count_as_activity(
        daemon: Client, cached_tensor: str, jp_serverapp: Any, jp_fetch: Fetch) -> None:
    settings = jp_serverapp.web_app.settings
    settings.pop("api_last_activity", None)
    before = jp_serverapp.web_app.last_activity()
    for _ in range(3):
        await jp_fetch(API, "status")
        await jp_fetch(API, "entries")
        await jp_fetch(API, "entries", cached_tensor)
        await jp_fetch(API, "zygotes")  # the sidebar polls it too
    assert "api_last_activity" not in settings
    assert jp_serverapp.web_app.last_activity() == before

    # A user's action does count (it proves the check above can fail).
    await jp_fetch(API, "entries", cached_tensor, "evict", method="POST", body=b"")
    assert settings["api_last_activity"] > before


# -- kernel transport (Note [Kernel messages without delays]) ----------------------------
async def test_kernel_websockets_send_without_nagle_and_sockets_reconnect_fast(
        jp_serverapp: Any, jp_fetch: Fetch, jp_ws_fetch: Any) -> None:
    import socket

    import zmq
    from jupyter_server.services.kernels.connection.channels import (
        ZMQChannelsWebsocketConnection,
    )

    from overmind_lab._jupyter_server.transport import RECONNECT_IVL_MAX_MS, RECONNECT_IVL_MS

    response = await jp_fetch("api", "kernels", method="POST",
                              body=json.dumps({"name": "python3"}))
    kid = json.loads(response.body)["id"]
    ws = None
    try:
        ws = await jp_ws_fetch("api", "kernels", kid, "channels",
                               params={"session_id": "nodelay-test"})
        handler = ZMQChannelsWebsocketConnection._open_sessions[f"{kid}:nodelay-test"]
        tcp = handler.ws_connection.stream.socket
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        # the server's sockets for the kernel (made after the extension loaded)
        km = jp_serverapp.kernel_manager.get_kernel(kid)
        for stream in handler.connection.channels.values():
            assert stream.socket.getsockopt(zmq.RECONNECT_IVL) == RECONNECT_IVL_MS
            assert stream.socket.getsockopt(zmq.RECONNECT_IVL_MAX) == RECONNECT_IVL_MAX_MS
        fresh = km.connect_shell()
        try:
            assert fresh.socket.getsockopt(zmq.RECONNECT_IVL) == RECONNECT_IVL_MS
        finally:
            fresh.close()
    finally:
        if ws is not None:
            ws.close()
        await jp_fetch("api", "kernels", kid, method="DELETE")


def test_another_kind_of_websocket_connection_is_left_alone() -> None:
    from jupyter_server.services.kernels.connection.channels import (
        ZMQChannelsWebsocketConnection,
    )

    from overmind_lab._jupyter_server.transport import _no_delay_websockets

    class Theirs:  # a configured class of another kind (a gateway's, say)
        pass

    settings: dict[str, Any] = {"kernel_websocket_connection_class": Theirs}
    assert not _no_delay_websockets(settings)
    assert settings["kernel_websocket_connection_class"] is Theirs

    settings = {"kernel_websocket_connection_class": ZMQChannelsWebsocketConnection}
    assert _no_delay_websockets(settings)
    wrapped = settings["kernel_websocket_connection_class"]
    assert issubclass(wrapped, ZMQChannelsWebsocketConnection)
    assert wrapped is not ZMQChannelsWebsocketConnection
    assert _no_delay_websockets(settings)  # once: loading twice wraps nothing more
    assert settings["kernel_websocket_connection_class"] is wrapped
