"""``%overmind_load`` and ``%overmind_status`` in a real IPython InteractiveShell, against a
real daemon."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

import overmind_lab
from overmind_lab import Client, OvermindWarning
from overmind_lab._common.display import (
    ENTRY_HEADERS,
    StatusReport,
    describe_load,
    format_seconds,
)

LOAD = "unet = UNet2DConditionModel.from_pretrained(p)"
WARM = re.compile(
    r"^warm \S+ m?s \(cold load was \S+ m?s, [\d.]+x\)  "
    r"UNet2DConditionModel\.from_pretrained\('.+'\)$")


@pytest.fixture
def shell(daemon: Client, tiny_unet_dir: Path) -> Iterator[InteractiveShell]:
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell.instance(config=config)
    sh.run_line_magic("load_ext", "overmind_lab")
    sh.user_ns["p"] = str(tiny_unet_dir)
    sh.run_cell("from diffusers import UNet2DConditionModel", store_history=False)
    yield sh
    sh.run_line_magic("unload_ext", "overmind_lab")
    overmind_lab.unpatch_all()
    for name in ("p", "unet", "a", "b", "s"):
        sh.user_ns.pop(name, None)


def lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_help_comes_from_the_docstring_and_magic_arguments(shell: InteractiveShell) -> None:
    doc = shell.find_line_magic("overmind_load").__doc__
    assert "%overmind_load [--cold] [--refresh] [--verify] [-q] [statement ...]" in doc
    assert "Cache ``from_pretrained`` in this kernel" in doc
    assert "--cold       run the statement without the cache" in doc
    assert shell.find_cell_magic("overmind_load") is not None
    assert "Show the cache" in shell.find_line_magic("overmind_status").__doc__


def test_without_a_statement_it_patches_the_kernel_and_prints_the_daemon(
        shell: InteractiveShell, daemon: Client, capsys: pytest.CaptureFixture[str]) -> None:
    assert not overmind_lab.is_patched()
    shell.run_line_magic("overmind_load", "")
    out = lines(capsys)
    assert overmind_lab.is_patched()
    assert out[0] == ("overmind-lab: from_pretrained of diffusers and transformers is cached "
                      "in this kernel.")
    assert out[1].startswith(f"daemon pid {daemon.status()['pid']} on {daemon.path}: 0 entries")
    shell.run_line_magic("overmind_load", "--quiet")
    assert lines(capsys) == []


def test_a_statement_loads_cold_then_warm_with_one_line_each(
        shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    shell.run_line_magic("overmind_load", LOAD)
    first = state(shell.user_ns["unet"])
    [cold] = lines(capsys)
    assert cold.startswith("cold ") and ", now cached  UNet2DConditionModel" in cold

    shell.run_line_magic("overmind_load", LOAD)
    [warm] = lines(capsys)
    assert WARM.match(warm), warm
    again = shell.user_ns["unet"]
    assert type(again).__name__ == "UNet2DConditionModel"
    assert all(torch.equal(first[k], v) for k, v in again.state_dict().items())


def test_the_cold_time_a_warm_line_compares_with_is_the_one_the_cold_line_shows(
        shell: InteractiveShell, daemon: Client, capsys: pytest.CaptureFixture[str]) -> None:
    """The first load's line splits its time into the load and the caching; the load part is the
    entry's ``cold_seconds``, which every warm line (and the sidebar) compares with."""
    shell.run_line_magic("overmind_load", LOAD)
    [cold] = lines(capsys)
    found = re.match(r"^cold (\S+ m?s) \(load (\S+ m?s) \+ cache it (\S+ m?s)\), now cached  ",
                     cold)
    assert found, cold
    shell.run_line_magic("overmind_load", LOAD)
    [warm] = lines(capsys)
    assert f"(cold load was {found.group(2)}, " in warm, (cold, warm)
    [entry] = daemon.entries()
    assert format_seconds(entry["cold_seconds"]) == found.group(2)


def test_a_load_that_starts_the_daemon_shows_that_time_apart(
        shell: InteractiveShell, daemon: Client, capsys: pytest.CaptureFixture[str]) -> None:
    """After the daemon stopped, a load that must wait for a new one says so, and the hit is
    compared with the cold load without the start (it was shown as 0.21x, a slow-down). The
    saved segment was touched meanwhile: only a daemon, which reads its checksum, may serve it
    (Note [A hit from the disk])."""
    shell.run_line_magic("overmind_load", "-q " + LOAD)
    assert daemon.stop()
    for segment in Path(os.environ["OVERMIND_LAB_CACHE_DIR"]).glob("*.seg"):
        os.utime(segment)  # its bytes the same, its identity not
    shell.run_line_magic("overmind_load", LOAD)
    [line] = lines(capsys)
    assert re.match(r"^warm (\S+ m?s) \(start the cache daemon \S+ m?s \+ hit \S+ m?s; "
                    r"cold load was \S+ m?s, ", line), line
    assert daemon.status()["running"]
    [entry] = daemon.entries()
    # the daemon's warm time is the hit's, without the start
    assert f"hit {format_seconds(entry['warm_seconds'][-1])};" in line


def test_a_load_with_no_daemon_serves_the_saved_entry_without_waiting(
        shell: InteractiveShell, daemon: Client, capsys: pytest.CaptureFixture[str]) -> None:
    """Note [A hit from the disk]: the saved entry, unchanged, is served at once (no start in
    its line), and a daemon starts meanwhile."""
    shell.run_line_magic("overmind_load", "-q " + LOAD)
    assert daemon.stop()
    shell.run_line_magic("overmind_load", LOAD)
    [line] = lines(capsys)
    assert re.match(r"^warm (\S+ m?s) \(cold load was \S+ m?s, ", line), line
    assert daemon.start()["running"]  # the one the load started (start waits for it)
    assert daemon.stop()


def test_a_hit_slower_than_its_cold_load_is_not_called_a_speed_up() -> None:
    from overmind_lab import LoadEvent

    name = "UNet2DConditionModel.from_pretrained('/m')"
    slow = LoadEvent("k", name, "warm", 0.63, cold_seconds=0.13)
    assert describe_load(slow) == f"warm 0.63 s (cold load was 0.13 s, this hit 4.8x slower)  {name}"
    assert slow.summary() == "warm 0.63 s (cold load was 0.13 s, this hit 4.8x slower)"
    fast = LoadEvent("k", name, "warm", 0.05, cold_seconds=2.91)
    assert fast.summary() == "warm 0.05 s (cold load was 2.91 s, 58x)"
    started = LoadEvent("k", name, "cold", 0.22, cold_seconds=0.13, daemon_seconds=0.4)
    assert describe_load(started, name=False) == (
        "cold 0.62 s (start the cache daemon 0.40 s + load 0.13 s + cache it 0.09 s), now cached")


def test_verify_compares_the_hit_with_a_plain_load(
        shell: InteractiveShell, daemon: Client, capsys: pytest.CaptureFixture[str]) -> None:
    shell.run_line_magic("overmind_load", LOAD)
    shell.run_line_magic("overmind_load", "--verify " + LOAD)
    [_, warm] = lines(capsys)
    assert warm.startswith("warm ") and "verified equal to a plain load" in warm, warm
    shell.run_line_magic("overmind_load", "--verify")
    assert "verify mode on" in lines(capsys)[0]
    try:
        shell.run_line_magic("overmind_load", LOAD)
        assert "verified equal to a plain load" in lines(capsys)[0]
    finally:
        overmind_lab.patch_all(verify=False)
    [entry] = daemon.entries()
    assert entry["verified"] == 2


def test_cold_bypasses_and_refresh_replaces_the_entry(
        shell: InteractiveShell, daemon: Client, capsys: pytest.CaptureFixture[str]) -> None:
    shell.run_line_magic("overmind_load", LOAD)
    [entry] = daemon.entries()
    lines(capsys)

    shell.run_line_magic("overmind_load", "--cold " + LOAD)
    [line] = lines(capsys)
    assert line.startswith("cold ") and "(cache bypassed)" in line
    assert daemon.entries()[0]["hits"] == entry["hits"]

    shell.run_line_magic("overmind_load", "--refresh " + LOAD)
    [line] = lines(capsys)
    assert line.startswith("cold ") and "now cached" in line
    [replaced] = daemon.entries()
    assert replaced["key"] == entry["key"] and replaced["created"] > entry["created"]

    shell.run_line_magic("overmind_load", "-q " + LOAD)
    assert lines(capsys) == []


def test_the_cell_magic_prints_one_line_per_load(
        shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    shell.run_cell_magic("overmind_load", "",
                         "a = UNet2DConditionModel.from_pretrained(p)\n"
                         "b = UNet2DConditionModel.from_pretrained(p, low_cpu_mem_usage=False)\n")
    out = lines(capsys)
    assert [line.split()[0] for line in out] == ["cold", "cold"]
    shell.run_cell_magic("overmind_load", "--quiet", "a = UNet2DConditionModel.from_pretrained(p)")
    assert lines(capsys) == []
    result = shell.run_cell_magic("overmind_load", "", "x = 1\nUNet2DConditionModel.from_pretrained(p)")
    assert WARM.match(lines(capsys)[0])
    assert type(result).__name__ == "UNet2DConditionModel"


def test_timeit_compares_cold_and_warm(
        shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    shell.run_line_magic("overmind_load", "-q " + LOAD)  # the entry exists
    cold = shell.run_line_magic("timeit", "-n1 -r3 -o %overmind_load --cold " + LOAD)
    out = lines(capsys)
    assert sum("(cache bypassed)" in line for line in out) == 3
    warm = shell.run_line_magic("timeit", "-n1 -r3 -o %overmind_load " + LOAD)
    out = lines(capsys)
    assert sum(bool(WARM.match(line)) for line in out) == 3
    assert len(cold.all_runs) == len(warm.all_runs) == 3
    assert "per loop" in out[-1]
    assert type(shell.user_ns["unet"]).__name__ == "UNet2DConditionModel"


def test_the_statement_reaches_python_verbatim(
        shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    shell.run_line_magic("overmind_load", 's = "a  --cold  b"  # it\'s kept')
    assert shell.user_ns["s"] == "a  --cold  b"
    assert lines(capsys) == [("overmind-lab: no cached load ran in this statement (only "
                             "from_pretrained / from_single_file and overmind_lab.load() "
                             "are cached)")]
    assert shell.run_line_magic("overmind_load", "-q -- 6 * 7") == 42


def test_an_error_in_the_statement_reaches_the_user_unchanged(
        shell: InteractiveShell, tmp_path: Path) -> None:
    shell.user_ns["missing"] = str(tmp_path / "missing")
    from diffusers import UNet2DConditionModel

    with pytest.raises(Exception) as plain:
        UNet2DConditionModel.from_pretrained(tmp_path / "missing")
    with pytest.raises(type(plain.value)):
        shell.run_line_magic("overmind_load", "x = UNet2DConditionModel.from_pretrained(missing)")


@pytest.mark.parametrize(("line", "cell", "message"), [
    ("--cold --refresh " + LOAD, None, "--cold and --refresh exclude each other"),
    ("--cold", None, "--cold needs a statement"),
    ("--refresh", None, "--refresh needs a statement"),
    ("--verify --cold " + LOAD, None, "--verify and --cold exclude each other"),
    ("--bogus " + LOAD, None, "unrecognized arguments: --bogus"),
    (LOAD, "a = 1", "%%overmind_load takes only options on its first line"),
])
def test_misuse_raises_usage_error(shell: InteractiveShell, line: str, cell: str | None,
                                   message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        if cell is None:
            shell.run_line_magic("overmind_load", line)
        else:
            shell.run_cell_magic("overmind_load", line, cell)


def test_status_is_html_in_lab_and_text_in_a_terminal(
        shell: InteractiveShell, daemon: Client, capsys: pytest.CaptureFixture[str]) -> None:
    shell.run_line_magic("overmind_load", "-q " + LOAD)
    shell.run_line_magic("overmind_load", "-q " + LOAD)
    report = shell.run_line_magic("overmind_status", "")
    assert isinstance(report, StatusReport)
    [entry] = report.entries
    assert shell.display_formatter is not None
    formats, _ = shell.display_formatter.format(report)
    html, text = formats["text/html"], formats["text/plain"]
    assert "<table>" in html and f'title="{entry["key"]}"' in html
    assert "UNet2DConditionModel.from_pretrained(" in html
    text_lines = text.splitlines()
    assert text_lines[0].startswith(f"daemon pid {daemon.status()['pid']}")
    assert text_lines[2].split()[:2] == ["name", "size"]
    assert text_lines[4].startswith("UNet2DConditionModel.from_pretrained(")
    row = report.rows()[0]
    assert row[ENTRY_HEADERS.index("hits")] == "1"
    assert all(cell in text_lines[4] for cell in row[:-1])
    with pytest.raises(UsageError):
        shell.run_line_magic("overmind_status", "--nope")


def test_status_without_a_daemon_says_so(shell: InteractiveShell, daemon: Client) -> None:
    daemon.stop()
    report = shell.run_line_magic("overmind_status", "")
    assert repr(report).startswith(f"no daemon is running on {daemon.path}")
    assert report.entries == []


def test_without_a_daemon_loads_run_uncached_with_a_warning(
        shell: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("OVERMIND_LAB_SOCKET", str(blocker / "d.sock"))
    shell.run_line_magic("overmind_load", "")
    out = lines(capsys)
    assert overmind_lab.is_patched()
    assert out[1].startswith("daemon unavailable, loads run uncached: ")
    with pytest.warns(OvermindWarning, match="the cache is unavailable"):
        shell.run_line_magic("overmind_load", LOAD)
    [line] = lines(capsys)
    assert line.startswith("loaded ") and " without the cache: " in line
    assert type(shell.user_ns["unet"]).__name__ == "UNet2DConditionModel"


def test_unload_ext_undoes_the_patching(shell: InteractiveShell) -> None:
    shell.run_line_magic("overmind_load", "-q")
    assert overmind_lab.is_patched()
    shell.run_line_magic("unload_ext", "overmind_lab")
    assert not overmind_lab.is_patched()
    assert shell.find_line_magic("overmind_load") is None
    shell.run_line_magic("load_ext", "overmind_lab")
