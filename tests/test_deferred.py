"""A warm transformers tokenizer's Rust tokenizer, built on first use: Note [A tokenizer built on
first use] in ``_loading/deferred.py``. Each hit is compared with a plain load of the same folder."""

from __future__ import annotations

import copy
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest

import overmind_lab
from overmind_lab._common.fingerprint import compare
from overmind_lab._loading import deferred
from overmind_lab._loading.client import Client

TEXT = "a photo of an astronaut riding a horse on mars <|endoftext|>"


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks.models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("clip") / "tok")


def _plain(path: Path) -> Any:
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(path)


def _warm(path: Path) -> Any:
    from transformers import CLIPTokenizer

    overmind_lab.load(CLIPTokenizer.from_pretrained, str(path))  # stores (or is a hit)
    with overmind_lab.record_loads() as events:
        tok = overmind_lab.load(CLIPTokenizer.from_pretrained, str(path))
    assert events[-1].outcome == "warm"
    return tok


def test_a_warm_tokenizer_is_built_on_first_use(daemon: Client, clip_dir: Path) -> None:
    plain, warm = _plain(clip_dir), _warm(clip_dir)
    assert deferred.pending(warm) and type(vars(warm)["_tokenizer"]) is deferred.Deferred
    assert list(vars(warm)) == list(vars(plain))  # the attribute in its place already
    assert warm(TEXT).input_ids == plain(TEXT).input_ids
    assert not deferred.pending(warm)
    assert list(vars(warm)) == list(vars(plain))  # the same attributes, in the same order
    assert warm.decode(warm(TEXT).input_ids) == plain.decode(plain(TEXT).input_ids)
    assert compare(warm, plain) is None


def test_a_second_hit_builds_its_own(daemon: Client, clip_dir: Path) -> None:
    one, two = _warm(clip_dir), _warm(clip_dir)
    assert one.backend_tokenizer is not two.backend_tokenizer


def _signature(tok: Any) -> tuple[Any, ...]:
    return (type(tok).__name__, list(vars(tok)), tok(TEXT).input_ids,
            tok.decode(tok(TEXT).input_ids), tok.backend_tokenizer.to_str())


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_copies_and_pickles_before_first_use_are_a_plain_loads(daemon: Client, clip_dir: Path,
                                                                how: str) -> None:
    """``copy`` shares the Rust tokenizer, ``deepcopy`` and ``pickle`` make a new one through
    tokenizers' own pickling (which drops CLIP's ``decode`` wrapper): as they do for a plain
    load's tokenizer, and the bytes name nothing of ours."""
    plain, warm = _plain(clip_dir), _warm(clip_dir)
    if how == "pickle":
        data = pickle.dumps(warm)
        assert b"overmind" not in data
        copies = pickle.loads(data), pickle.loads(pickle.dumps(plain))
    else:
        do = copy.copy if how == "copy" else copy.deepcopy
        copies = do(warm), do(plain)
    assert _signature(copies[0]) == _signature(copies[1])
    assert _signature(warm) == _signature(plain)
    shares = [c.backend_tokenizer is o.backend_tokenizer for c, o in zip(copies, (warm, plain), strict=True)]
    assert shares[0] == shares[1] == (how == "copy")


def test_threads_reading_it_first_get_one_tokenizer(daemon: Client, clip_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    warm = _warm(clip_dir)
    built = []
    real = deferred.Deferred.values

    def counting(self: deferred.Deferred) -> dict[str, Any]:
        built.append(1)
        return real(self)

    monkeypatch.setattr(deferred.Deferred, "values", counting)
    start = threading.Barrier(4)
    seen: list[Any] = []

    def read() -> None:
        start.wait()
        seen.append(warm.backend_tokenizer)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 4 and len({id(s) for s in seen}) == 1
    assert built == [1]


def test_a_value_set_before_first_use_stays(daemon: Client, clip_dir: Path) -> None:
    warm, other = _warm(clip_dir), _plain(clip_dir).backend_tokenizer
    warm._tokenizer = other
    assert warm.backend_tokenizer is other
    copy.copy(warm)  # completes it
    assert not deferred.pending(warm) and warm.backend_tokenizer is other


def test_its_dictionary_and_del_before_first_use_are_a_plain_loads(
        daemon: Client, clip_dir: Path) -> None:
    """A reference to ``__dict__`` taken before the first read sees the build and keeps what is
    written through it; ``del`` of the attribute before the first read works as on a plain
    load (the class's ``None`` afterwards)."""
    plain, warm = _plain(clip_dir), _warm(clip_dir)
    state = warm.__dict__
    state["user_note"] = "kept"
    assert warm(TEXT).input_ids == plain(TEXT).input_ids  # built on this read
    assert warm.__dict__ is state and state["user_note"] == "kept"
    assert state["_tokenizer"] is warm.backend_tokenizer
    gone, plain_gone = _warm(clip_dir), _plain(clip_dir)
    del gone._tokenizer
    del plain_gone._tokenizer
    assert gone._tokenizer is None and plain_gone._tokenizer is None
    assert list(vars(gone)) == list(vars(plain_gone))
    with pytest.raises(AttributeError):
        del gone._tokenizer
    with pytest.raises(AttributeError):
        del plain_gone._tokenizer


@pytest.mark.parametrize("hold", ["backend", "decode"])
def test_a_tokenizer_held_elsewhere_is_pickled_in_place(daemon: Client, clip_dir: Path,
                                                        hold: str) -> None:
    """The other reference and the tokenizer's own stay one object after a hit."""
    from tests.loaders import tokenizer_held_twice

    overmind_lab.load(tokenizer_held_twice, str(clip_dir), hold)
    with overmind_lab.record_loads() as events:
        warm = overmind_lab.load(tokenizer_held_twice, str(clip_dir), hold)
    assert events[-1].outcome == "warm"
    tok = warm["tok"]
    assert not deferred.pending(tok)
    backend = tok._tokenizer
    assert warm["other"] is (backend if hold == "backend" else backend.decode)


def test_closed_counts_every_reference(clip_dir: Path) -> None:
    tok = _plain(clip_dir)
    root = tok._tokenizer
    assert deferred.closed(root, 1)
    held = [root.decode]  # the wrapper, held from outside
    assert not deferred.closed(root, 1)
    del held
    assert deferred.closed(root, 1)
    again = root
    assert not deferred.closed(root, 1)
    del again
    assert deferred.closed(root, 1)
