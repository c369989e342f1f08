"""Note [A quiet zygote log] (``_zygote/preload.py``): the zygote's log says what the zygote did,
not what its imports tell a user who is not there; a warm kernel still shows every warning a
plain kernel shows.

The second test runs a real zygote and real kernels through jupyter_client, as
``tests/test_warm_kernel.py`` does (its helpers, its small preload set plus debugpy's importer).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests import test_warm_kernel as warm
from tests.test_warm_kernel import Kernel, private_zygote_dir, ready_zygote

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

DEBUGGER = "Debugger warning"
#: Warnings as torchvision gives them at import (Note [A quiet zygote log]), from their modules.
TORCHVISION = """
warnings.warn_explicit("Failed to load image Python extension: 'libc10_cuda.so: cannot open "
                       "shared object file'", UserWarning, "image.py", 13,
                       module="torchvision.io.image")
warnings.warn_explicit("The torchvision.datapoints and torchvision.transforms.v2 namespaces "
                       "are still Beta.", UserWarning, "__init__.py", 54,
                       module="torchvision.transforms.v2")
"""


def test_imports_inside_quiet_imports_say_nothing_and_leave_no_trace() -> None:
    pytest.importorskip("debugpy")
    code = textwrap.dedent("""
        import json, os, sys, warnings
        from overmind_lab._zygote import preload
        before = [repr(f) for f in warnings.filters]
        with preload.quiet_imports():
            import ipykernel.debugger  # debugpy's report of frozen modules, at import
            # as a module does at its import (IPython's completer): a filter that stays
            warnings.filterwarnings("error", category=FutureWarning, module="made.inside")
    """) + "    " + TORCHVISION.strip().replace("\n", "\n    ") + textwrap.dedent("""
        sys.stderr.write("-- after --\\n")
        after = [repr(f) for f in warnings.filters]
        print(json.dumps([[f for f in after if f not in before], [f for f in before if f not in after],
                          os.environ.get("PYDEVD_DISABLE_FILE_VALIDATION")]))
    """) + TORCHVISION
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items()
                                            if k != "PYDEVD_DISABLE_FILE_VALIDATION"})
    assert proc.returncode == 0, proc.stderr
    inside, _, after = proc.stderr.partition("-- after --\n")
    assert inside == "", inside
    # the filters the imports left, without ours; the variable as it was
    added, removed, variable = json.loads(proc.stdout)
    assert added == ["('error', None, <class 'FutureWarning'>, re.compile('made.inside'), 0)"]
    assert removed == [] and variable is None
    # the same warnings outside are shown, as anywhere else
    assert "UserWarning: Failed to load image Python extension" in after
    assert "UserWarning: The torchvision.datapoints and torchvision.transforms.v2" in after
    without = subprocess.run([sys.executable, "-c", "import ipykernel.debugger"],
                             capture_output=True, text=True, timeout=120)
    assert DEBUGGER in without.stderr  # what the zygote's log used to open with


#: A cell that imports what the zygote preloaded (their imports add filters: numpy's, torch's),
#: warns as a user's code or torchvision would, and reports the filters.
CELL = "import json, warnings, numpy, torch, threadpoolctl, ipykernel.debugger\n" + TORCHVISION + """
warnings.warn("a warning of the user's own")
print(json.dumps(sorted({repr(f) for f in warnings.filters})))
"""


def _run(kernel: Kernel, code: str) -> tuple[str, str]:
    """stdout and stderr of a cell."""
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out[msg["content"]["name"]].append(msg["content"]["text"])

    reply = kernel.kc.execute_interactive(code, timeout=120, output_hook=hook)
    assert reply["content"]["status"] == "ok", out
    return "".join(out["stdout"]), "".join(out["stderr"])


@pytest.mark.slow
def test_the_zygote_log_says_only_what_matters_and_kernels_warn_as_plain_ones() -> None:
    with private_zygote_dir("olq-") as d:
        # debugpy's importer too, as every zygote preloads it (DEFAULT_PRELOAD)
        preload = f"{warm.PRELOAD},ipykernel.debugger"
        os.environ["OVERMIND_LAB_PRELOAD"] = warm.LAUNCH_ENV["OVERMIND_LAB_PRELOAD"] = preload
        plain = Kernel()
        try:
            assert not plain.warm
            plain_out = _run(plain, CELL)
        finally:
            plain.close()
        zygote = ready_zygote(d)
        kernel = Kernel()
        try:
            assert kernel.warm, kernel.log_text()
            warm_out = _run(kernel, CELL)
        finally:
            kernel.close()
        [log] = d.glob("zygote-*.log")
        text = log.read_text()
    # the log opens with the zygote's own ready line: no debugger report, no library warning
    lines = text.splitlines()
    assert re.fullmatch(rf"\S+ \S+ zygote {zygote['pid']} INFO zygote {zygote['pid']} ready "
                        r"in .*", lines[0]), text
    assert DEBUGGER not in text and "Warning" not in text, text
    # a warm kernel shows what a plain one shows, the filtered messages included
    plain_filters, warm_filters = json.loads(plain_out[0]), json.loads(warm_out[0])
    assert warm_filters == plain_filters, (
        [f for f in warm_filters if f not in plain_filters],
        [f for f in plain_filters if f not in warm_filters])
    def cell_file(err: str) -> str:  # a cell's file names its kernel's pid
        return re.sub(r"/ipykernel_\d+/", "/ipykernel_N/", err)

    assert cell_file(warm_out[1]) == cell_file(plain_out[1])
    stdout, stderr = warm_out
    for said in ("UserWarning: Failed to load image Python extension",
                 "UserWarning: The torchvision.datapoints and torchvision.transforms.v2",
                 "UserWarning: a warning of the user's own"):
        assert said in stderr, stderr
    assert not any("torchvision" in f for f in json.loads(stdout))
