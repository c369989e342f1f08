"""The decoding example's lean forward and methods on random Llama-family configs.

No training: small random ``LlamaForCausalLM`` models with the options people's pairs use
(attention and MLP biases, grouped-query attention, a ``head_dim`` of its own, every rope
scaling type transformers has for Llama, tied embeddings, another activation). The lean
forward must give transformers' logits (max abs difference <= 1e-4 in fp32), every method
transformers' greedy ``generate`` token for token, a ragged batch the per-prompt results,
and sampling the target's distribution (chi-square over every 3-token continuation of a
small-vocabulary model, at T = 0.7 with K = 2).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "decoding"))
import decoding  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Note [One thread] in decoding.py: tiny steps, shared cores
    yield
    torch.set_num_threads(threads)

ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
             "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.2 * i for i in range(8)],
                 "original_max_position_embeddings": 128},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}

#: (name, options): each row of the grid turns on a few options at once.
GRID: list[tuple[str, dict[str, Any]]] = [
    ("plain", {}),
    ("attention_bias", {"attention_bias": True}),
    ("mlp_bias", {"mlp_bias": True}),
    ("gqa 4:2", {"num_key_value_heads": 2}),
    ("gqa 4:1 + head_dim 24", {"num_key_value_heads": 1, "head_dim": 24}),
    ("head_dim 8 + biases", {"head_dim": 8, "attention_bias": True, "mlp_bias": True}),
    ("tied", {"tie_word_embeddings": True}),
    ("gelu", {"hidden_act": "gelu"}),
    *((f"rope {name}", {"rope_parameters": params}) for name, params in ROPE.items()
      if name != "default"),
    ("rope llama3 + gqa + biases + head_dim + tied",
     {"rope_parameters": ROPE["llama3"], "num_key_value_heads": 2, "attention_bias": True,
      "mlp_bias": True, "head_dim": 32, "tie_word_embeddings": True}),
]


def _config(vocab: int = 97, layers: int = 3, **options: Any) -> Any:
    from transformers import LlamaConfig

    # head_dim 16 with 4 heads; rope parameters sized for head_dim 16 (longrope's factors)
    base: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 256, "initializer_range": 0.2,
        "rope_parameters": ROPE["default"], "tie_word_embeddings": False}
    base.update(options)
    if "head_dim" in options and "longrope" in str(base["rope_parameters"]):
        raise AssertionError("longrope's factors are sized for head_dim 16")
    return LlamaConfig(**base)


def _model(seed: int, **options: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_config(**options)).eval()


@pytest.mark.parametrize(("name", "options"), GRID, ids=[name for name, _ in GRID])
def test_the_lean_forward_computes_what_transformers_computes(
        name: str, options: dict[str, Any]) -> None:
    model = _model(1, **options)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (1, 40), generator=gen)
    with torch.inference_mode():
        expected = model(ids).logits[0]
        run = decoding.Runner(model)
        cache = run.new_cache(64)
        whole = run.forward(ids[0].tolist(), cache)
        cache.crop(10)  # roll back, then feed the rest in pieces: the same logits
        pieces = torch.cat([run.forward(ids[0, 10:25].tolist(), cache),
                            *(run.forward([t], cache) for t in ids[0, 25:].tolist())])
        # ragged rows of one batch, each at its own position (Note [Ragged rows])
        batch = run.new_cache(64, batch=2)
        x, widths = run.embed_rows([ids[0, :12].tolist(), ids[0, :5].tolist()])
        run.run_rows(x, [0, 0], batch)
        x, _ = run.embed_rows([ids[0, 12:20].tolist(), ids[0, 5:20].tolist()])
        ragged = run.logits(run.run_rows(x, [12, 5], batch))
    assert float((whole - expected).abs().max()) <= 1e-4, name
    assert float((pieces - expected[10:]).abs().max()) <= 1e-4, name
    assert float((ragged[0, :8] - expected[12:20]).abs().max()) <= 1e-4, name
    assert float((ragged[1] - expected[5:20]).abs().max()) <= 1e-4, name


def test_what_the_lean_forward_cannot_run_gets_a_clear_error() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(MistralConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"^expected a LlamaForCausalLM, got "
                                         r"MistralForCausalLM \(model_type 'mistral'\)$"):
        decoding.Runner(mistral)
    ids = torch.zeros(1, 200, dtype=torch.long)
    for rope, limit in (("dynamic", 256), ("longrope", 128)):
        model = _model(3, rope_parameters=ROPE[rope])
        with pytest.raises(ValueError, match=rf"^rope_type '{rope}' changes its frequencies "
                                             rf"past {limit} positions"):
            decoding.greedy(model, ids, 100, stop=())
    decoding.greedy(_model(3, rope_parameters=ROPE["yarn"]), ids, 100, stop=())  # any length


# -- every method is transformers' greedy generate -------------------------------------------

Method = Callable[..., Any]


def _methods(target: Any, draft: Any) -> dict[str, Method]:
    """Every method, at settings that make it exact: ``method(ids, n, **kw)``."""
    layers = int(target.config.num_hidden_layers)
    return {
        "greedy": lambda ids, n, **kw: decoding.greedy(target, ids, n, **kw),
        "speculative k=1": lambda ids, n, **kw: decoding.speculative(
            target, draft, ids, n, 1, **kw),
        "speculative k=4": lambda ids, n, **kw: decoding.speculative(
            target, draft, ids, n, 4, **kw),
        "speculative adaptive": lambda ids, n, **kw: decoding.speculative(
            target, draft, ids, n, 6, confidence=0.3, **kw),
        "self-speculative": lambda ids, n, **kw: decoding.self_speculative(
            target, ids, n, 3, 1, **kw),
        "self-speculative adaptive": lambda ids, n, **kw: decoding.self_speculative(
            target, ids, n, 5, layers - 1, confidence=0.2, **kw),
        "prompt lookup": lambda ids, n, **kw: decoding.prompt_lookup(target, ids, n, 4, **kw),
        "early exit, nobody leaves": lambda ids, n, **kw: decoding.early_exit(
            target, ids, n, 1.01, **kw),
    }


PAIRS = [
    ("biases + gqa + head_dim", {"attention_bias": True, "mlp_bias": True,
                                 "num_key_value_heads": 2, "head_dim": 24}),
    ("gqa 4:1 + tied + llama3", {"num_key_value_heads": 1, "tie_word_embeddings": True,
                                 "rope_parameters": ROPE["llama3"]}),
]


@pytest.fixture(scope="module", params=PAIRS, ids=[name for name, _ in PAIRS])
def random_pair(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    _, options = request.param
    return _model(10, layers=4, **options), _model(11, layers=1, **options)


def _prompts(count: int, seed: int, vocab: int = 97) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # repeated pieces, so that prompt lookup finds n-grams
    out = []
    for i in range(count):
        piece = torch.randint(0, vocab, (1, 3 + i), generator=gen)
        out.append(torch.cat([piece, torch.randint(0, vocab, (1, 4 + 2 * i), generator=gen),
                              piece], dim=1))
    return out


def test_every_method_is_transformers_greedy_generate(random_pair: tuple[Any, Any]) -> None:
    target, draft = random_pair
    n = 24
    for ids in _prompts(4, seed=20):
        with torch.inference_mode():
            out = target.generate(ids, max_new_tokens=n, do_sample=False)
        expected = out[0, ids.shape[1]:]  # stops at the config's eos_token_id, as do ours
        for name, method in _methods(target, draft).items():
            tokens, stats = method(ids, n)
            assert torch.equal(tokens, expected), (name, tokens.tolist(), expected.tolist())
            assert sum(stats["tokens_per_pass"]) == len(tokens)


def test_a_ragged_batch_equals_the_prompts_one_by_one(random_pair: tuple[Any, Any]) -> None:
    target, draft = random_pair
    prompts = _prompts(4, seed=30)[::-1] + _prompts(1, seed=31)
    stop = {int(t) for t in decoding.greedy(target, prompts[1], 6, stop=())[0][-2:]}
    for name, method in _methods(target, draft).items():
        for kw in ({"stop": ()}, {"stop": stop}):
            batch = method(prompts, 20, **kw)
            assert isinstance(batch, list) and len(batch) == len(prompts)
            for i, (ids, (tokens, stats)) in enumerate(zip(prompts, batch, strict=True)):
                alone, _ = method(ids, 20, **kw)
                assert torch.equal(tokens, alone), (name, kw, i, tokens.tolist(),
                                                    alone.tolist())
                assert stats["batch"] == len(prompts)
            if kw["stop"]:  # the stop tokens ended a sequence, and were its last token
                lengths = [len(t) for t, _ in batch]
                assert min(lengths) < 20, name
                for tokens, _ in batch:
                    hits = [j for j, t in enumerate(tokens.tolist()) if t in stop]
                    assert hits in ([], [len(tokens) - 1]), name


def test_stop_tokens_default_to_the_models_end_of_sequence() -> None:
    model = _model(40)
    ids = _prompts(1, seed=41)[0]
    free, _ = decoding.greedy(model, ids, 30, stop=())
    assert len(free) == 30
    model.generation_config.eos_token_id = int(free[7])
    first = free.tolist().index(int(free[7]))
    tokens, _ = decoding.greedy(model, ids, 30)
    assert tokens.tolist() == free.tolist()[:first + 1]
    tokens, _ = decoding.speculative(model, _model(42, layers=1), ids, 30, 4,
                                     stop=[int(free[3])])
    assert tokens.tolist() == free.tolist()[:free.tolist().index(int(free[3])) + 1]


# -- sampling: the target's distribution, exactly ---------------------------------------------

VOCAB = 8
SAMPLES = 2000
N = 3  # tokens per run: a round of K = 2 drafts commits all three


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    from tests.test_decoding import _chi_square_p as p

    return p(observed, expected)


def _exact(target: Any, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """p(x1, x2, x3 | ids) for every 3-token continuation, flattened."""
    prob = torch.ones(1, dtype=torch.float64)
    contexts = ids
    with torch.inference_mode():
        run = decoding.Runner(target)
        for _ in range(N):
            logits = run.logits(run.hidden_states(contexts)[-1])[:, -1]
            step = torch.softmax(logits.double() / temperature, -1)  # [contexts, VOCAB]
            prob = (prob.view(-1, 1) * step).flatten()
            contexts = torch.cat([contexts.repeat_interleave(VOCAB, 0),
                                  torch.arange(VOCAB).repeat(contexts.shape[0]).view(-1, 1)],
                                 dim=1)
    return prob


@pytest.fixture(scope="module")
def small() -> tuple[Any, Any, torch.Tensor]:
    """A small-vocabulary pair that disagrees clearly (so that a wrong rule shows), with a
    prompt that ends in a repeated bigram (so that prompt lookup drafts)."""
    # large weights: peaked distributions; the draft is the target's first layer (and its
    # embeddings, norm and head) with noise added, so it agrees with it often, not always
    target = _model(50, vocab=VOCAB, layers=3, initializer_range=0.5)
    draft = _model(51, vocab=VOCAB, layers=1, initializer_range=0.5)
    gen = torch.Generator().manual_seed(52)
    with torch.no_grad():
        own = target.state_dict()
        for name, value in draft.state_dict().items():
            value.copy_(own[name] + 0.3 * value.std() * torch.randn(value.shape, generator=gen))
    ids = torch.tensor([[1, 5, 2, 7, 1, 5, 2, 0, 3, 1, 5]])
    return target, draft, ids


SAMPLERS: dict[str, Callable[..., Any]] = {
    "speculative k=2": lambda t, d, ids, temp, g: decoding.speculative(
        t, d, ids, N, 2, temp, generator=g, stop=()),
    "speculative adaptive k=2": lambda t, d, ids, temp, g: decoding.speculative(
        t, d, ids, N, 2, temp, generator=g, confidence=0.6, stop=()),
    "self-speculative k=2": lambda t, d, ids, temp, g: decoding.self_speculative(
        t, ids, N, 2, 1, temp, generator=g, stop=()),
    "prompt lookup k=2": lambda t, d, ids, temp, g: decoding.prompt_lookup(
        t, ids, N, 2, temperature=temp, generator=g, stop=()),
}


def _sample(sampler: Callable[..., Any], target: Any, draft: Any, ids: torch.Tensor,
            temperature: float, seed: int) -> tuple[torch.Tensor, int]:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB ** N, dtype=torch.float64)
    accepted = 0
    for _ in range(SAMPLES):
        tokens, stats = sampler(target, draft, ids, temperature, gen)
        cell = 0
        for t in tokens.tolist():
            cell = cell * VOCAB + t
        counts[cell] += 1
        accepted += sum(stats["accepted"])
    return counts, accepted


@pytest.mark.parametrize("method", list(SAMPLERS))
def test_sampling_follows_the_target_distribution(
        method: str, small: tuple[Any, Any, torch.Tensor]) -> None:
    target, draft, ids = small
    exact = _exact(target, ids, 0.7)
    counts, accepted = _sample(SAMPLERS[method], target, draft, ids, 0.7, seed=0)
    # drafts were used, not only corrections (few lookups match this model's samples)
    assert accepted > (0 if "lookup" in method else SAMPLES // 20)
    assert _chi_square_p(counts, exact * SAMPLES) > 0.01, method


@pytest.mark.parametrize("broken", ["accept every draft", "target without its temperature"])
def test_the_chi_square_test_rejects_a_broken_sampler(
        broken: str, small: tuple[Any, Any, torch.Tensor],
        monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft, ids = small
    exact = _exact(target, ids, 0.7)
    if broken == "accept every draft":
        monkeypatch.setattr(decoding, "accept_probability", lambda p, q: torch.ones(()))
    else:
        verify = decoding._verify
        monkeypatch.setattr(decoding, "_verify",
                            lambda logits, d, q, temperature, g: verify(logits, d, q, 1.0, g))
    for method in ("speculative k=2", "self-speculative k=2"):
        counts, _ = _sample(SAMPLERS[method], target, draft, ids, 0.7, seed=0)
        assert _chi_square_p(counts, exact * SAMPLES) < 0.01, (broken, method)
