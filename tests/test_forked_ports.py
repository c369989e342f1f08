"""Note [Ports bound at the fork]: a forked kernel listens on its ports before ipykernel binds
them, and a client that connected early gets its reply without waiting for a reconnect.

Each case runs in a subprocess: ``bind_kernel_ports`` wraps ``IPKernelApp._try_bind_socket``
for the rest of the process, as it does in a forked kernel.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from overmind_lab._forked.ports import connection_file


def test_connection_file_is_found_in_every_spelling() -> None:
    assert connection_file(["-f", "/k.json"]) == "/k.json"
    assert connection_file(["--f", "k.json", "--debug"]) == "k.json"
    assert connection_file(["--f=/a b.json"]) == "/a b.json"
    assert connection_file(["-f=/x.json"]) == "/x.json"
    assert connection_file(["--HistoryManager.enabled=False"]) is None
    assert connection_file(["-f"]) is None


_CHILD = textwrap.dedent("""
    import json, socket, sys
    import zmq
    import ipykernel.kernelapp
    from jupyter_client.connect import write_connection_file
    from overmind_lab._forked import ports

    path, info = write_connection_file(fname=sys.argv[1], ip="127.0.0.1")
    bound = ports.bind_kernel_ports(["-f", path])
    assert bound == sorted(info[k] for k in ("shell_port", "iopub_port", "stdin_port",
                                             "control_port")), (bound, info)
    ctx = zmq.Context()
    # A client connects and sends before the kernel's socket exists ...
    client = ctx.socket(zmq.DEALER)
    client.linger = 0
    client.connect(f"tcp://127.0.0.1:{info['shell_port']}")
    client.send(b"early")
    # ... a second connection reaches the listening socket at once (no refusal, no retry)
    probe = socket.create_connection(("127.0.0.1", info["shell_port"]), timeout=5)
    probe.close()

    class App:  # what _try_bind_socket reads of the app
        transport = "tcp"
        ip = "127.0.0.1"

    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = ipykernel.kernelapp.IPKernelApp._try_bind_socket(App(), router, info["shell_port"])
    assert port == info["shell_port"]
    assert router.poll(10_000), "the early message never arrived"
    ident, body = router.recv_multipart()
    # A port not bound beforehand is bound by ipykernel as usual.
    other = ctx.socket(zmq.ROUTER)
    other.linger = 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert ipykernel.kernelapp.IPKernelApp._try_bind_socket(App(), other, free) == free
    print(json.dumps({"body": body.decode()}))
    for s in (client, router, other):
        s.close()
    ctx.term()
""")


def test_an_early_client_is_served_by_the_socket_that_binds_later(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "kernel.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["body"] == "early"


def test_nothing_is_bound_for_ipc_or_a_host_name(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import json, sys
        import ipykernel.kernelapp
        from overmind_lab._forked import ports
        for i, info in enumerate([{"transport": "ipc", "ip": "/tmp/k", "shell_port": 1},
                                  {"transport": "tcp", "ip": "localhost", "shell_port": 5}]):
            path = f"{sys.argv[1]}/{i}.json"
            open(path, "w").write(json.dumps(info))
            assert ports.bind_kernel_ports(["-f", path]) == [], info
        assert ports.bind_kernel_ports(["-f", f"{sys.argv[1]}/missing.json"]) == []
        assert ports.bind_kernel_ports([]) == []
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
