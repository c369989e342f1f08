"""Key normalization in-process: what makes two loads the same entry, and what cannot.

Plain values and real files in a temporary folder; no daemon.
"""

from __future__ import annotations

import enum
from pathlib import Path

import pytest
import torch

from overmind_lab._common import dists
from overmind_lab._errors import NotCacheable
from overmind_lab._loading.keys import make_key, normalize


def loader(path: str, dtype: object = None, *, scale: float = 1.0, **extra: object) -> None:
    """A stand-in for ``from_pretrained``: its first argument is the source."""


class Color(enum.Enum):
    RED = 1


def test_plain_values_are_canonical() -> None:
    assert normalize(3, "x") == 3 and normalize(None, "x") is None
    assert normalize(0.1, "x") == {"float": "0.1"}
    assert normalize((1, 2), "x") == {"tuple": [1, 2]}
    assert normalize([1, 2], "x") == {"list": [1, 2]}  # a list is not a tuple
    assert normalize({"b": 1, "a": 2}, "x") == normalize({"a": 2, "b": 1}, "x")
    assert normalize({1: "x", 0: "y"}, "x") == normalize({0: "y", 1: "x"}, "x")
    assert normalize(Color.RED, "x") == {"enum": f"{__name__}.Color.RED"}
    assert normalize(int, "x") == {"type": "builtins.int"}
    assert normalize(torch.float16, "x") == {"dtype": "torch.float16"}
    assert normalize(torch.device("cpu"), "x") == {"device": "cpu"}


def test_true_and_one_stay_apart() -> None:
    assert make_key(loader, ("/nonexistent", True), {}).key != make_key(
        loader, ("/nonexistent", 1), {}).key


def test_objects_without_a_description_are_refused() -> None:
    with pytest.raises(NotCacheable, match="argument opts of type builtins.object"):
        normalize(object(), "opts")


def test_the_same_call_spelled_differently_gives_one_key(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    a = make_key(loader, (str(tmp_path),), {"scale": 1.0})
    b = make_key(loader, (), {"path": str(tmp_path)})  # keyword, default filled in
    c = make_key(loader, (str(tmp_path), None), {})
    assert a.key == b.key == c.key
    assert a.source == str(tmp_path)
    assert make_key(loader, (str(tmp_path),), {"scale": 2.0}).key != a.key
    assert make_key(loader, (str(tmp_path),), {"extra_arg": 1}).key != a.key


def test_a_changed_source_changes_the_key(tmp_path: Path) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"1" * 10)
    before = make_key(loader, (str(tmp_path),), {}).key
    assert make_key(loader, (tmp_path,), {}).key == before  # str or Path: one source
    weights.write_bytes(b"2" * 11)
    assert make_key(loader, (str(tmp_path),), {}).key != before


def test_local_functions_are_keyed_by_their_code() -> None:
    def make(n: int) -> object:
        return lambda path: n

    assert make_key(make(1), ("/x",), {}).key == make_key(make(1), ("/x",), {}).key
    assert make_key(make(1), ("/x",), {}).key != make_key(make(2), ("/x",), {}).key


def test_library_versions_come_from_dist_info_names_as_importlib_finds_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from overmind_lab._loading import keys

    installed = keys._installed_versions()
    for dist in keys._VERSIONED:  # this environment: the same answers as importlib
        try:
            expected: str | None = metadata.version(dist.replace("_", "-"))
        except metadata.PackageNotFoundError:
            expected = None
        assert installed.get(dist) == expected
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, names in ((first, ["HuggingFace.Hub-9.9.dist-info", "peft.egg-info"]),
                          (second, ["huggingface_hub-1.0.dist-info", "torch-0.1.dist-info"])):
        for name in names:
            (folder / name).mkdir(parents=True)
    (first / "peft.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: peft\n"
                                                      "Version: 0.7.1\n")
    monkeypatch.setattr("sys.path", [str(tmp_path / "absent"), str(first), str(second)])
    found = dists.dist_info_versions()
    assert found["huggingface_hub"] == "9.9"  # the first along sys.path wins
    assert found["torch"] == "0.1" and found["peft"] == ""
    keys._installed_versions.cache_clear()
    try:
        got = keys._installed_versions()
    finally:
        keys._installed_versions.cache_clear()
    assert got["torch"] == "0.1" and got["huggingface_hub"] == "9.9"
    assert got["peft"] == "0.7.1"  # an egg: importlib reads its PKG-INFO
    assert "diffusers" not in got  # not on this sys.path
