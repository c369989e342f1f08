"""A loader's error through the cache looks like the plain call's: same type, message, cause and
context, the user's line with its source, the loader's frames, and at most one frame of ours
(Note [Tracebacks that show the user's code] in ``_loading/load.py``, Note [The statement's own
traceback] in ``_loading/magics.py``). Real scripts, a real ``InteractiveShell``, a real daemon,
real model folders."""

from __future__ import annotations

import json
import re
import tempfile
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

import overmind_lab
from overmind_lab import Client
from overmind_lab._loading.load import _plain, loader_traceback

from .conftest import run_py

PACKAGE = str(Path(overmind_lab.__file__).parent) + "/"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def save_broken_pipeline(root: Path) -> Path:
    """A real ``DDPMPipeline`` folder whose UNet's weights file is cut short: the error comes
    from deep inside a component load, a nested ``from_pretrained``."""
    import torch
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(32, 64), norm_num_groups=8,
                       down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler()).save_pretrained(root)
    [weights] = (root / "unet").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    return root


# The script: each case runs plainly, then through the cache; every call is on a line of its own
# (the user's line), and what Python would print is recorded.
SCRIPT = '''
import json, sys, traceback
import overmind_lab
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DConditionModel
from transformers import AutoTokenizer

MISSING, BROKEN = sys.argv[1], sys.argv[2]
out = {}


def my_loader(path):
    return UNet2DConditionModel.from_pretrained(path)


def record(name, call):
    try:
        call()
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        chained = [(type(e).__name__, str(e)) if e is not None else None
                   for e in (exc.__cause__, exc.__context__)]
        out[name] = {"type": type(exc).__name__, "message": str(exc), "chained": chained,
                     "suppress": exc.__suppress_context__,
                     "frames": [[f.filename, f.lineno, f.name, f.line] for f in frames],
                     "text": "".join(traceback.format_exception(exc))}
    else:
        raise AssertionError(name + " did not fail")


def cases(mode):
    record(mode + " unet", lambda: UNet2DConditionModel.from_pretrained(MISSING))
    record(mode + " pipeline", lambda: DDPMPipeline.from_pretrained(BROKEN))
    record(mode + " scheduler", lambda: DDPMScheduler.from_pretrained(MISSING))
    record(mode + " tokenizer", lambda: AutoTokenizer.from_pretrained(MISSING))
    record(mode + " nested", lambda: my_loader(MISSING) if mode == "plain" else overmind_lab.load(my_loader, MISSING))
    record(mode + " load", lambda: UNet2DConditionModel.from_pretrained(MISSING) if mode == "plain" else overmind_lab.load(UNet2DConditionModel.from_pretrained, MISSING))


cases("plain")
overmind_lab.patch_all()
cases("cached")
print(json.dumps(out))
'''

CASES = ("unet", "pipeline", "scheduler", "tokenizer", "nested", "load")


def ours(frames: list[list[Any]]) -> list[list[Any]]:
    return [f for f in frames if f[0].startswith(PACKAGE)]


def below_the_user(frames: list[list[Any]], script: str) -> list[tuple[str, str]]:
    """(file, function) of the frames below the user's lambda, ours left out."""
    start = max(i for i, f in enumerate(frames) if f[0] == script)
    return [(Path(f[0]).name, f[2]) for f in frames[start + 1:] if not f[0].startswith(PACKAGE)]


@pytest.fixture(scope="module")
def script_results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("tracebacks")
    script = root / "user_script.py"
    script.write_text(SCRIPT)
    broken = save_broken_pipeline(root / "pipeline")
    with tempfile.TemporaryDirectory(prefix="olt-", dir="/tmp") as d:
        env = {**OFFLINE, "OVERMIND_LAB_SOCKET": f"{d}/d.sock",
               "OVERMIND_LAB_CACHE_DIR": f"{d}/cache"}
        try:
            proc = run_py(f"import sys, runpy; sys.argv = [{str(script)!r}, "
                          f"{str(root / 'missing')!r}, {str(broken)!r}]; "
                          f"runpy.run_path({str(script)!r}, run_name='__main__')", env=env)
        finally:
            Client(Path(d) / "d.sock").stop()
    yield str(script), json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_a_script_sees_the_plain_calls_error_and_frames(
        script_results: tuple[str, dict[str, Any]], case: str) -> None:
    script, results = script_results
    plain, cached = results[f"plain {case}"], results[f"cached {case}"]
    assert (cached["type"], cached["message"]) == (plain["type"], plain["message"])
    assert cached["chained"] == plain["chained"]
    assert cached["suppress"] == plain["suppress"]
    [user] = [f for f in cached["frames"] if f[0] == script and f[2] == "<lambda>"]
    assert user[3].startswith(f"record(mode + \" {case}\", lambda: "), user  # its real source
    assert len(ours(cached["frames"])) <= 1, cached["text"]
    assert below_the_user(cached["frames"], script) == below_the_user(plain["frames"], script)
    assert "Could not get source" not in cached["text"]


def test_the_nested_component_load_keeps_the_loaders_frames(
        script_results: tuple[str, dict[str, Any]]) -> None:
    """A pipeline's component fails inside its own (nested, patched) ``from_pretrained``: the
    frames of diffusers down to the weights file are all there, ours between them are not."""
    script, results = script_results
    frames = below_the_user(results["cached pipeline"]["frames"], script)
    assert ("pipeline_utils.py", "from_pretrained") in frames
    assert ("modeling_utils.py", "from_pretrained") in frames  # the UNet's own load
    [entry] = ours(results["cached pipeline"]["frames"])
    assert entry[2] == "cached" and entry[3].startswith("raise error  # the loader's own")


def test_an_uncaught_error_in_a_script_shows_the_users_line(
        daemon: Client, tmp_path: Path) -> None:
    script = tmp_path / "typo.py"
    script.write_text(textwrap.dedent(f"""
        import overmind_lab
        overmind_lab.patch_all()
        from diffusers import UNet2DConditionModel
        unet = UNet2DConditionModel.from_pretrained({str(tmp_path / 'typo')!r})
    """))
    proc = run_py(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
                  env=OFFLINE, check=False)
    assert proc.returncode == 1
    last = proc.stderr.split("During handling of the above exception")[-1]
    files = re.findall(r'^  File "([^"]+)", line \d+, in (\S+)$', last, re.M)
    assert (str(script), "<module>") in files
    assert f"    unet = UNet2DConditionModel.from_pretrained({str(tmp_path / 'typo')!r})" in last
    assert len([f for f, _ in files if f.startswith(PACKAGE)]) == 1, last
    assert proc.stderr.strip().splitlines()[-2].startswith("OSError: ")


# -- an error of ours keeps its frames ---------------------------------------------------------
def test_an_error_of_ours_is_not_cut() -> None:
    """Only what came out of the loader (through ``_plain``) is cut; our own error keeps every
    frame, so a bug of the cache is never passed off as the loader's."""
    def loader() -> None:
        raise ValueError("the loader's")

    try:
        _plain(loader, (), {})
    except ValueError as exc:
        found, frames = loader_traceback(exc.__traceback__)
        assert found and frames is not None
        assert [frames.tb_frame.f_code.co_name, frames.tb_next] == ["loader", None]
    with pytest.warns(overmind_lab.OvermindWarning, match="cannot bind the arguments"), \
            pytest.raises(TypeError, match="positional argument") as raised:
        overmind_lab.load(loader, 1)  # a wrong argument: the call itself raises, in _plain
    files = [e.filename for e in traceback.extract_tb(raised.value.__traceback__)]
    assert len([f for f in files if f.startswith(PACKAGE)]) == 1, files  # load, not _plain
    from overmind_lab._loading.load import _rebuild

    try:
        _rebuild({"segments": [{"id": "x", "size": 1}]}, [], {})  # type: ignore[typeddict-item]
    except overmind_lab.OvermindError as exc:
        assert loader_traceback(exc.__traceback__) == (False, exc.__traceback__)


# -- IPython ---------------------------------------------------------------------------------
@pytest.fixture
def shell(daemon: Client, monkeypatch: pytest.MonkeyPatch) -> Iterator[InteractiveShell]:
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell.instance(config=config)
    sh.run_line_magic("load_ext", "overmind_lab")
    sh.run_cell("import overmind_lab\nfrom diffusers import UNet2DConditionModel",
                store_history=False)
    yield sh
    sh.run_line_magic("unload_ext", "overmind_lab")
    overmind_lab.unpatch_all()
    sh.user_ns.pop("missing", None)


def shown(sh: InteractiveShell, cell: str, capsys: pytest.CaptureFixture[str]) -> str:
    """What the user sees under the cell: the traceback's last exception, as text."""
    capsys.readouterr()
    result = sh.run_cell(cell, store_history=True)
    assert result.error_in_exec is not None
    text = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # colours, if a shell before us set them
    return text.split("During handling of the above exception")[-1]


def frames_shown(text: str) -> list[str]:
    return re.findall(r"^(?:File (\S+?):\d+|Cell In\[\d+\], line \d+)", text, re.M)


@pytest.mark.parametrize(("cell", "statement"), [
    ("%overmind_load x = UNet2DConditionModel.from_pretrained(missing)",
     "x = UNet2DConditionModel.from_pretrained(missing)"),
    ("%overmind_load x = overmind_lab.load(UNet2DConditionModel.from_pretrained, missing)",
     "x = overmind_lab.load(UNet2DConditionModel.from_pretrained, missing)"),
    ("%%overmind_load\ny = 1\nx = UNet2DConditionModel.from_pretrained(missing)",
     "x = UNet2DConditionModel.from_pretrained(missing)"),
    ("%overmind_load\nx = UNet2DConditionModel.from_pretrained(missing)", None),
    ("overmind_lab.load(UNet2DConditionModel.from_pretrained, missing)", None),
])
def test_ipython_shows_the_statement_and_one_frame_of_ours(
        shell: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        cell: str, statement: str | None) -> None:
    shell.user_ns["missing"] = str(tmp_path / "missing")
    plain = shown(shell, "overmind_lab.get_original(UNet2DConditionModel, 'from_pretrained')"
                         "(missing)", capsys)
    text = shown(shell, cell, capsys)
    assert text.strip().splitlines()[-1] == plain.strip().splitlines()[-1]  # type: message
    assert "Could not get source" not in text
    files = frames_shown(text)
    assert files[0] == ""  # the cell
    assert len([f for f in files if f.startswith(PACKAGE)]) <= 1, text
    if statement is not None:
        assert re.search(r"^File <%overmind_load-\d+>:\d+\n(?:.*\n)*?----> \d+ " + re.escape(statement),
                         text, re.M), text
    loader = [Path(f).name for f in files if f and not f.startswith(PACKAGE)
              and not f.startswith("<")]
    assert loader == [Path(f).name for f in frames_shown(plain) if f]


def test_a_syntax_error_in_the_statement_shows_it_and_one_frame_of_ours(
        shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    """IPython lists a ``SyntaxError``'s frames without hiding any: the magic's re-raise is
    the one of ours shown; the statement is shown with its source."""
    text = shown(shell, "%overmind_load x = (1 +", capsys)
    assert re.search(r"^  File <%overmind_load-\d+>:1\n    x = \(1 \+$", text, re.M), text
    assert text.count(PACKAGE) == 1, text
    assert text.strip().splitlines()[-1] == "SyntaxError: incomplete input"


def test_a_usage_error_is_still_a_usage_error(
        shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    result = shell.run_cell("%overmind_load --cold --refresh x = 1")
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert "--cold and --refresh exclude each other" in capsys.readouterr().err
