"""The decoding example (``examples/decoding/decoding.py``) on the trained pair it builds.

Exactness is asserted token for token: greedy speculative decoding and self-speculative
decoding equal greedy decoding of the target on 50 held-out prompts for K in {1, 2, 4, 8}.
Speculative sampling is checked against the target's exact distribution with a
chi-square test, and the same test must reject a broken acceptance rule. Speed is not
asserted here: ``python -m benchmarks --only decoding`` measures it.

The models are built (trained, about 10 minutes on 2 cores) once into ``.models/`` at the
repository root, or ``$OVERMIND_LAB_DECODING_MODELS``; later runs reuse them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "decoding"))
import decoding  # noqa: E402

MODELS = Path(os.environ.get("OVERMIND_LAB_DECODING_MODELS", REPO / ".models"))

# The first test builds the models when they are missing (the fixture's time counts).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="session")
def pair() -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = decoding.build(MODELS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # single-token steps: threads only add synchronisation
    try:
        yield (AutoModelForCausalLM.from_pretrained(target_dir).eval(),
               AutoModelForCausalLM.from_pretrained(draft_dir).eval())
    finally:
        torch.set_num_threads(threads)


# -- building ------------------------------------------------------------------------------


def test_build_is_idempotent_and_the_models_learned(pair: tuple[Any, Any]) -> None:
    target_dir, draft_dir = decoding.build(MODELS)
    before = {p: p.stat().st_mtime_ns for d in (target_dir, draft_dir) for p in d.iterdir()}
    assert decoding.build(MODELS) == (target_dir, draft_dir)
    assert {p: p.stat().st_mtime_ns for d in (target_dir, draft_dir)
            for p in d.iterdir()} == before
    target_record = decoding.read_marker(target_dir)
    draft_record = decoding.read_marker(draft_dir)
    assert target_record is not None and draft_record is not None
    config = json.loads((target_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 8 and config["hidden_size"] == 128
    assert json.loads((draft_dir / "config.json").read_text())["num_hidden_layers"] == 1
    # uniform bytes are log(256) = 5.55 nats; trained ones are far below, on unseen files too
    assert target_record["held_out_losses"][-1] < 2.0
    assert draft_record["held_out_losses"][-1] < 2.5
    # the distilled draft comes close to its teacher on unseen files (Note [A distilled draft])
    assert draft_record["held_out_losses"][-1] < target_record["held_out_losses"][-1] + 0.3
    # the early-exit loss made every exit a language model, better with depth
    exits = target_record["held_out_losses"]
    assert len(exits) == 8 and exits[0] < 3.0
    assert exits[-1] < exits[len(exits) // 2] < exits[0]


def test_an_interrupted_build_leaves_nothing_that_looks_built(tmp_path: Path) -> None:
    path = tmp_path / "m"
    spec = {"name": "x", "version": 1}

    def crash(out: Path) -> dict[str, Any]:
        (out / "weights").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        decoding._build_one(path, spec, crash)
    assert not path.exists() and (tmp_path / ".m.partial").exists()

    calls = []

    def write(out: Path) -> dict[str, Any]:
        calls.append(out)
        (out / "weights").write_text("whole")
        return {"seconds": 0.0}

    assert decoding._build_one(path, spec, write) == path
    assert decoding._build_one(path, spec, write) == path  # found finished: not rebuilt
    assert len(calls) == 1 and not (tmp_path / ".m.partial").exists()
    assert (path / "weights").read_text() == "whole"
    assert decoding.read_marker(path) == {"spec": spec, "versions": decoding._versions(),
                                          "seconds": 0.0}
    decoding._build_one(path, {**spec, "version": 2}, write)  # another recipe: rebuilt
    assert len(calls) == 2

    foreign = tmp_path / "f"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="was not built by decoding.build"):
        decoding._build_one(foreign, spec, write)
    assert (foreign / "mine.txt").read_text() == "keep"


def test_a_quick_build_and_a_version_bump(tmp_path: Path) -> None:
    target_dir, draft_dir = decoding.build(tmp_path, steps=4)
    assert (target_dir.name, draft_dir.name) == ("decoding-target-4steps", "decoding-draft-4steps")
    target_record = decoding.read_marker(target_dir)
    draft_record = decoding.read_marker(draft_dir)
    assert target_record is not None and draft_record is not None
    assert target_record["steps"] == 4 and draft_record["steps"] == 9  # 4 * 1200 / 520
    # Note [A distilled draft]: the draft learned the target's distributions, and a draft
    # of another target is another recipe
    assert draft_record["distilled"] is True and target_record["distilled"] is False
    assert draft_record["spec"]["teacher"] == target_record["spec"]
    assert "distill" not in target_record["spec"]["train"]
    assert target_record["versions"] == decoding._versions()

    # Note [Version bumps]: other library versions, a model that still loads: reused
    bumped = {**target_record, "versions": {"torch": "0.0", "transformers": "0.0"}}
    (target_dir / decoding.MARKER).write_text(json.dumps(bumped))
    before = {p.name: p.stat().st_mtime_ns for p in target_dir.iterdir()}
    assert decoding.build(tmp_path, steps=4) == (target_dir, draft_dir)
    assert {p.name: p.stat().st_mtime_ns for p in target_dir.iterdir()} == before
    # ... and one that no longer loads: rebuilt
    (target_dir / "config.json").write_text("{}")
    decoding.build(tmp_path, steps=4)
    assert json.loads((target_dir / "config.json").read_text())["num_hidden_layers"] == 8
    assert decoding.read_marker(target_dir)["versions"] == decoding._versions()  # type: ignore[index]
    with pytest.raises(ValueError, match=r"^steps must be an integer >= 1, got 0$"):
        decoding.build(tmp_path, steps=0)


def test_bytes_round_trip() -> None:
    ids = decoding.encode("def f(x):\n    return x  # é")
    assert ids.dtype == torch.long and ids.shape == (1, 28)  # é is two bytes
    assert decoding.decode(ids[0]) == "def f(x):\n    return x  # é"
    assert decoding.decode([0xFF]) == "\ufffd"


# -- the lean forward ----------------------------------------------------------------------


def test_the_lean_forward_computes_what_transformers_computes(pair: tuple[Any, Any]) -> None:
    ids = decoding.prompts(1, length=40)[0]
    for model in pair:
        with torch.inference_mode():
            expected = model(ids).logits[0]
            run = decoding.Runner(model)
            cache = run.new_cache(64)
            whole = run.forward(ids[0].tolist(), cache)
            cache.crop(10)  # roll back, then feed the rest in pieces: the same logits
            pieces = torch.cat([run.forward(ids[0, 10:25].tolist(), cache),
                                *(run.forward([t], cache) for t in ids[0, 25:].tolist())])
        torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pieces, expected[10:], atol=1e-4, rtol=1e-4)


def test_a_draft_step_is_the_forward_of_one_token(pair: tuple[Any, Any]) -> None:
    # Note [A draft's first layer by token]: the table row and the scaled head change the
    # last bits and the scale, never the logits beyond that or their order
    ids = decoding.prompts(1, length=30, seed=5)[0][0].tolist()
    for model in pair:
        with torch.inference_mode():
            run = decoding.Runner(model)
            plain, stepped = run.new_cache(64), run.new_cache(64)
            run.forward(ids[:18], plain)
            run.forward(ids[:18], stepped)
            expected = run.forward(ids[18:20], plain)[-1:]  # two tokens at once, as a catch-up
            torch.testing.assert_close(run.draft_step(ids[18:20], 18, stepped), expected,
                                       atol=1e-4, rtol=1e-4)
            for i, token in enumerate(ids[20:]):
                expected = run.forward([token], plain)
                got = run.draft_step([token], 20 + i, stepped)
                ranked = run.draft_step([token], 20 + i, stepped, ranking=True)  # same position
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
                assert int(ranked.argmax()) == int(expected.argmax())
                assert torch.equal(ranked.argsort(descending=True)[0, :3],
                                   expected.argsort(descending=True)[0, :3])
            torch.testing.assert_close(stepped.k[:, :, :, :30], plain.k[:, :, :, :30],
                                       atol=1e-4, rtol=1e-4)


# -- exactness -----------------------------------------------------------------------------


def test_speculative_and_self_speculative_equal_greedy(pair: tuple[Any, Any]) -> None:
    target, draft = pair
    n = 32
    accepted = 0
    prompts = [ids for j in range(5) for ids in decoding.prompts(10, length=24 + 8 * j, seed=11 + j)]
    for i, ids in enumerate(prompts):
        expected, stats = decoding.greedy(target, ids, n)
        assert expected.shape == (n,) and stats["target_passes"] == n
        exit_layer = 1 + i % 7
        for k in (1, 2, 4, 8):
            tokens, stats = decoding.speculative(target, draft, ids, n, k, temperature=0)
            assert torch.equal(tokens, expected), (i, k, decoding.decode(tokens),
                                                   decoding.decode(expected))
            _check_rounds(stats, n, k)
            accepted += sum(stats["accepted"])
            tokens, stats = decoding.self_speculative(target, ids, n, k, exit_layer)
            assert torch.equal(tokens, expected), (i, k, exit_layer)
            _check_rounds(stats, n, k)
    assert accepted > 0  # the draft's tokens were used, not only the target's corrections


def _check_rounds(stats: dict[str, Any], n: int, k: int) -> None:
    assert sum(stats["tokens_per_pass"]) == n
    assert stats["target_passes"] == len(stats["tokens_per_pass"]) == len(stats["accepted"])
    for acc, prop, made in zip(stats["accepted"], stats["proposed"], stats["tokens_per_pass"],
                               strict=True):
        assert 0 <= acc <= prop <= k and made == acc + 1


# -- speculative sampling: the target's distribution, exactly -------------------------------

SAMPLES = 3000


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 are pooled into one."""
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if float(exp[-1]) < 5:  # too little left over to be a cell of its own
        obs, exp = obs[:-1], exp[:-1]
        obs[-1] += observed[~big].sum()
        exp[-1] += expected[~big].sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    # the chi-square survival function is the regularized upper incomplete gamma function
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _exact_pairs(target: Any, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """p(x1, x2 | ids) for every pair of bytes, flattened to 65536 cells."""
    with torch.inference_mode():
        run = decoding.Runner(target)
        first = torch.softmax(run.logits(run.hidden_states(ids)[-1])[0, -1] / temperature, -1)
        both = torch.cat([ids.expand(256, -1), torch.arange(256).view(256, 1)], dim=1)
        second = torch.softmax(run.logits(run.hidden_states(both)[-1])[:, -1] / temperature, -1)
    return (first.view(256, 1) * second).flatten().double()


def _sample_pairs(pair: tuple[Any, Any], ids: torch.Tensor, temperature: float,
                  seed: int, k: int = 1) -> torch.Tensor:
    """Counts of the first two tokens; with *k* = 2, of three-token runs (one round drafts
    both: the second is a draft checked after an accepted one)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(256 * 256, dtype=torch.float64)
    for _ in range(SAMPLES):
        tokens, _ = decoding.speculative(*pair, ids, k + 1, k=k, temperature=temperature,
                                         generator=gen)
        counts[tokens[0] * 256 + tokens[1]] += 1
    return counts


def _next_token(model: Any, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    run = decoding.Runner(model)
    logits = run.forward(ids[0].tolist(), run.new_cache(ids.shape[1]))[-1]
    return torch.softmax(logits / temperature, -1)


@pytest.fixture(scope="module")
def sampling_case(pair: tuple[Any, Any]) -> tuple[torch.Tensor, float]:
    """A context where the draft and the target disagree clearly (so that a wrong rule
    shows), among a few held-out prompts: the one with the largest total variation."""
    target, draft = pair
    temperature = 1.0
    best: tuple[float, torch.Tensor] = (-1.0, torch.empty(0))
    with torch.inference_mode():
        for ids in decoding.prompts(12, length=20, seed=5):
            p, q = (_next_token(m, ids, temperature) for m in (target, draft))
            tv = float((p - q).abs().sum()) / 2
            best = max(best, (tv, ids), key=lambda b: b[0])
    assert best[0] > 0.1, f"the draft and the target agree too well to test ({best[0]:.3f})"
    return best[1], temperature


@pytest.mark.parametrize(("temperature", "k"), [(1.0, 1), (0.7, 2)])
def test_speculative_sampling_follows_the_target_distribution(
        pair: tuple[Any, Any], sampling_case: tuple[torch.Tensor, float], temperature: float,
        k: int) -> None:
    ids, _ = sampling_case
    exact = _exact_pairs(pair[0], ids, temperature)
    counts = _sample_pairs(pair, ids, temperature, seed=0, k=k)
    assert _chi_square_p(counts, exact * SAMPLES) > 0.01


def test_the_chi_square_test_rejects_a_broken_acceptance_rule(
        pair: tuple[Any, Any], sampling_case: tuple[torch.Tensor, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ids, temperature = sampling_case
    exact = _exact_pairs(pair[0], ids, temperature)
    monkeypatch.setattr(decoding, "accept_probability", lambda p, q: torch.ones(()))
    counts = _sample_pairs(pair, ids, temperature, seed=0)
    assert _chi_square_p(counts, exact * SAMPLES) < 0.01


# -- early exit ----------------------------------------------------------------------------


def test_early_exit(pair: tuple[Any, Any]) -> None:
    target, _ = pair
    ids = decoding.prompts(1, seed=3)[0]
    expected, _ = decoding.greedy(target, ids, 24)
    tokens, stats = decoding.early_exit(target, ids, 24, [1.01] * 7)  # nobody leaves
    assert torch.equal(tokens, expected) and stats["exit_layers"] == [8] * 24
    tokens, stats = decoding.early_exit(target, ids, 24, 0.0)  # everybody leaves at once
    assert stats["exit_layers"] == [8] + [1] * 23

    threshold, agreement = decoding.calibrate_threshold(
        target, decoding.prompts(4, seed=21), 32, agreement=0.95)
    assert agreement >= 0.95 and threshold < 1.0
    layers = []
    for ids in decoding.prompts(4, seed=22):
        _, stats = decoding.early_exit(target, ids, 32, threshold)
        layers += stats["exit_layers"][1:]
    assert sum(layers) / len(layers) < 8  # some tokens did leave early


# -- bad input -----------------------------------------------------------------------------


def test_bad_input_gets_a_clear_error(pair: tuple[Any, Any]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    target, draft = pair
    ids = decoding.encode("import os\n")
    with pytest.raises(ValueError, match=r"^k \(draft tokens per round\) must be an integer "
                                         r">= 1, got 0$"):
        decoding.speculative(target, draft, ids, 8, k=0)
    with pytest.raises(ValueError, match=r"k \(draft tokens per round\)"):
        decoding.self_speculative(target, ids, 8, k=-1, exit_layer=2)
    other = LlamaForCausalLM(LlamaConfig(**{**decoding.DRAFT_CONFIG, "vocab_size": 300}))
    with pytest.raises(ValueError, match=r"^the draft's vocabulary \(300 tokens\) differs from "
                                         r"the target's \(256 tokens\)"):
        decoding.speculative(target, other, ids, 8, k=2)
    with pytest.raises(ValueError, match=r"^thresholds has 3 values, but the target has 8 "
                                         r"layers: give 7"):
        decoding.early_exit(target, ids, 8, [0.9, 0.9, 0.9])
    with pytest.raises(ValueError, match=r"exit_layer must be an integer in 1\.\.7"):
        decoding.self_speculative(target, ids, 8, k=2, exit_layer=8)
    with pytest.raises(ValueError, match=r"ids must be a LongTensor of shape \[1, prompt_len\]"):
        decoding.greedy(target, ids[0], 8)
    with pytest.raises(ValueError, match=r"temperature must be >= 0"):
        decoding.speculative(target, draft, ids, 8, k=2, temperature=-1)
