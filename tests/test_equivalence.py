"""A warm hit is indistinguishable from a plain load: keys, randomness, classes,
exceptions, recorders, replayed warnings, and verify mode (real daemon, real models)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch

import overmind_lab
from overmind_lab import Client, OvermindError, OvermindWarning, VerifyMismatch
from overmind_lab._common.fingerprint import compare
from tests import loaders

TINY_LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaModel(LlamaConfig(**TINY_LLAMA)).save_pretrained(path)
    return path


def _load(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    with overmind_lab.record_loads() as events:
        result = overmind_lab.load(fn, *args, **kwargs)
    return result, events[-1]


# 1 -------------------------------------------------------------------------------------
def test_hidden_config_fields_are_part_of_the_key(daemon: Client, llama_dir: Path) -> None:
    from transformers import LlamaConfig, LlamaModel

    eager = LlamaConfig.from_pretrained(llama_dir)
    eager._attn_implementation = "eager"
    sdpa = LlamaConfig.from_pretrained(llama_dir)
    sdpa._attn_implementation = "sdpa"
    first, _ = _load(LlamaModel.from_pretrained, llama_dir, config=eager)
    second, event = _load(LlamaModel.from_pretrained, llama_dir, config=sdpa)
    assert first.config._attn_implementation == "eager"
    assert second.config._attn_implementation == "sdpa", event
    again, event = _load(LlamaModel.from_pretrained, llama_dir, config=eager)
    assert event.outcome == "warm" and again.config._attn_implementation == "eager"


# 2 -------------------------------------------------------------------------------------
def _seeded(seed: int, llama_dir: Path, cached: bool) -> tuple[torch.Tensor, float, str]:
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OvermindWarning)
        if cached:
            model, event = _load(LlamaForSequenceClassification.from_pretrained, llama_dir,
                                 num_labels=3)
            outcome = event.outcome
        else:
            model = LlamaForSequenceClassification.from_pretrained(llama_dir, num_labels=3)
            outcome = "plain"
    return model.score.weight.detach().clone(), float(torch.rand(1)), outcome


def test_loads_that_draw_random_numbers_follow_the_seed(daemon: Client,
                                                        llama_dir: Path) -> None:
    plain0, after0, _ = _seeded(0, llama_dir, cached=False)
    plain1, after1, _ = _seeded(1, llama_dir, cached=False)
    assert not torch.equal(plain0, plain1)
    for seed, head, after in ((0, plain0, after0), (1, plain1, after1), (0, plain0, after0)):
        got, got_after, outcome = _seeded(seed, llama_dir, cached=True)
        assert outcome == "uncached"
        assert torch.equal(got, head), f"seed {seed} gave another head than a plain load"
        assert got_after == after, "the random stream after the load differs"
    assert Client().entries() == []


def test_a_load_that_draws_random_numbers_says_why_it_is_not_cached(
        daemon: Client, llama_dir: Path) -> None:
    from transformers import LlamaForSequenceClassification

    with overmind_lab.record_loads() as events, pytest.warns(OvermindWarning,
                                                             match="random numbers"):
        overmind_lab.load(LlamaForSequenceClassification.from_pretrained, llama_dir,
                          num_labels=5)
    assert events[-1].outcome == "uncached" and "torch" in (events[-1].reason or "")


# 3 -------------------------------------------------------------------------------------
def test_a_locally_defined_class_comes_back_as_itself(daemon: Client,
                                                      tmp_path: Path) -> None:
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

    class TinyNet(ModelMixin, ConfigMixin):  # defined here, as tests and notebooks do
        @register_to_config
        def __init__(self, width: int = 4) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(width, width)

    torch.manual_seed(0)
    TinyNet().save_pretrained(tmp_path / "net")
    outcomes = []
    with pytest.warns(OvermindWarning, match="not cached"):  # once, not on every load
        for _ in range(2):
            net, event = _load(TinyNet.from_pretrained, tmp_path / "net")
            assert isinstance(net, TinyNet) and type(net) is TinyNet
            outcomes.append(event.outcome)
    assert outcomes == ["uncached", "uncached"]
    assert Client().entries() == []


# 4 -------------------------------------------------------------------------------------
def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in out:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def test_exceptions_of_an_uncacheable_call_carry_nothing_of_ours(daemon: Client) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OvermindWarning)
        with pytest.raises(ValueError, match="cannot load") as info:
            overmind_lab.load(loaders.failing_load, "/nowhere", option=object())
    assert not any(isinstance(e, OvermindError) for e in _chain(info.value)), _chain(info.value)


def test_exceptions_with_the_daemon_unavailable_carry_nothing_of_ours(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OVERMIND_LAB_SOCKET", str(tmp_path / ("x" * 120) / "d.sock"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OvermindWarning)
        with pytest.raises(ValueError, match="cannot load") as info:
            overmind_lab.load(loaders.failing_load, "/nowhere")
    assert not any(isinstance(e, OvermindError) for e in _chain(info.value)), _chain(info.value)


# 5 -------------------------------------------------------------------------------------
def test_nested_recorders_both_see_loads_and_leave_cleanly(daemon: Client) -> None:
    with overmind_lab.record_loads() as outer:
        with overmind_lab.record_loads() as inner:
            pass
        overmind_lab.load(loaders.sized_load, 4096, "nested")
    assert [e.outcome for e in outer] == ["cold"]
    assert inner == []


# What the user sees ---------------------------------------------------------------------
def test_a_hit_replays_the_warnings_and_log_records_of_the_cold_load(
        daemon: Client) -> None:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("transformers")
    handler = Keep()
    logger.addHandler(handler)
    try:
        for outcome in ("cold", "warm"):
            with pytest.warns(UserWarning, match="7 values are made up"):
                _, event = _load(loaders.noisy_load, 7)
            assert event.outcome == outcome
    finally:
        logger.removeHandler(handler)
    assert seen == ["noisy_load could not fetch 7", "noisy_load logged 7"] * 2


def test_every_record_of_a_long_burst_is_recorded_once() -> None:
    """Records freed as soon as they are handled reuse each other's ids; none is lost,
    and one that reaches two watched loggers (``transformers`` and root) counts once."""
    from overmind_lab._loading.observe import Capture

    child = logging.getLogger("transformers.modeling_utils")
    with Capture(emit=False) as capture:
        for i in range(50):
            child.warning("record %d", i)
        library = logging.getLogger("transformers")
        propagate, library.propagate = library.propagate, True
        try:
            child.warning("through two loggers")
        finally:
            library.propagate = propagate
    assert [r["msg"] for r in capture.observed.logs] == (
        [f"record {i}" for i in range(50)] + ["through two loggers"])


# Verify mode ----------------------------------------------------------------------------
def test_verify_mode_passes_an_equal_hit_and_counts_it(daemon: Client,
                                                       llama_dir: Path) -> None:
    from transformers import LlamaModel

    _load(LlamaModel.from_pretrained, llama_dir)
    with overmind_lab.verifying(), warnings.catch_warnings():
        warnings.simplefilter("error", VerifyMismatch)
        model, event = _load(LlamaModel.from_pretrained, llama_dir)
    assert event.outcome == "warm" and event.verified is True
    assert overmind_lab.key_of(model) is not None  # the warm object, not the plain one
    [entry] = Client().entries()
    assert entry["verified"] == 1 and entry["hits"] == 1


def test_verify_mode_catches_an_injected_difference(daemon: Client) -> None:
    loaders.HIDDEN_SCALE[0] = 1.0
    _load(loaders.scaled_load, 8)
    loaders.HIDDEN_SCALE[0] = 2.0  # the key cannot see this: a hit would be stale
    try:
        stale, event = _load(loaders.scaled_load, 8)
        assert event.outcome == "warm" and float(stale[0]) == 1.0  # what a key miss does
        with overmind_lab.verifying():
            with pytest.warns(VerifyMismatch, match=r"differs from plain load in the "
                                                    r"result storage: storage 32 bytes .* vs "):
                fixed, event = _load(loaders.scaled_load, 8)
    finally:
        loaders.HIDDEN_SCALE[0] = 1.0
    assert float(fixed[0]) == 2.0 and event.verified is False
    assert Client().entries() == []  # the entry was dropped


def test_verify_mode_is_switched_on_by_the_environment(
        daemon: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    _load(loaders.sized_load, 4096, "env")
    monkeypatch.setenv("OVERMIND_LAB_VERIFY", "1")
    _, event = _load(loaders.sized_load, 4096, "env")
    assert event.outcome == "warm" and event.verified is True
    monkeypatch.setenv("OVERMIND_LAB_VERIFY", "0")
    _, event = _load(loaders.sized_load, 4096, "env")
    assert event.verified is None


def test_a_result_pickle_refuses_loads_plainly_with_one_warning(daemon: Client) -> None:
    # Note [Never worse than plain]: torch raises RuntimeError (not PicklingError) for a
    # parametrized module; the load is uncached, with one warning, and nothing is stored.
    plain = loaders.weight_normed(4)
    with pytest.warns(overmind_lab.OvermindWarning, match="not cached: .*RuntimeError"):
        first, event = _load(loaders.weight_normed, 4)
    assert event.outcome == "uncached"
    again, event = _load(loaders.weight_normed, 4)
    assert event.outcome == "uncached" and Client().entries() == []
    x = torch.ones(4)
    assert torch.equal(first(x), plain(x)) and torch.equal(again(x), plain(x))


def test_a_first_load_is_the_loaders_own_object_and_no_finaliser_runs(
        daemon: Client) -> None:
    loaders.FINALISED.clear()
    first, event = _load(loaders.finalised, 3)
    assert event.outcome == "cold" and loaders.FINALISED == []
    assert overmind_lab.key_of(first) == event.key  # a component by reference later
    warm, event = _load(loaders.finalised, 3)
    assert event.outcome == "warm" and loaders.FINALISED == []
    assert compare(warm, first) is None
