"""Speculative decoding and early exit on two small byte-level Llama models.

Import it with ``examples/decoding`` on ``sys.path``::

    import decoding
    target_dir, draft_dir = decoding.build("../../.models")   # trains once, then reuses
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    ids = decoding.encode("def main(")
    tokens, stats = decoding.speculative(target, draft, ids, 64, k=4, temperature=0)
    print(decoding.decode(tokens), stats["tokens_per_pass"])

The models are ordinary ``LlamaForCausalLM`` directories (``save_pretrained``), so
``from_pretrained`` loads them and overmind-lab caches them. The vocabulary is the 256
byte values: :func:`encode` is ``text.encode("utf-8")``.

The decoding functions
----------------------

All take ``ids`` (a ``LongTensor`` of shape ``[1, prompt_len]``) and ``n`` (new tokens),
and return ``(tokens, stats)``: ``tokens`` is a 1-D ``LongTensor`` of the ``n`` new tokens
and ``stats`` a dict (see :func:`speculative`).

- :func:`greedy`: one target pass per token.
- :func:`speculative`: the draft proposes ``k`` tokens, the target scores them in one
  pass. ``temperature=0`` accepts the longest prefix equal to the target's argmax (the
  output equals :func:`greedy` token for token); ``temperature>0`` is speculative
  sampling (accept with :func:`accept_probability`, resample a rejection from the
  residual ``max(p - q, 0)``), whose output follows the target's distribution exactly.
- :func:`early_exit`: the shared LM head after the final norm on every layer; a token
  leaves at the first layer whose max probability clears its threshold.
- :func:`self_speculative`: the target's first ``exit_layer`` layers are the draft, the
  full target verifies (exact, like greedy speculative decoding).

They run the models through a lean forward (:class:`Runner`) over the weights of the
Hugging Face modules, with a preallocated KV cache per model: a rejection rolls the
cache back by setting its length. A per-token step is a few dozen tensor operations,
so what a step costs is the layers it runs, not Python overhead of the generic
``forward`` (which dominates models this small on a CPU); ``greedy`` uses the same
forward, so the speed ratios compare like with like.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "DRAFT_CONFIG",
    "TARGET_CONFIG",
    "KVCache",
    "Runner",
    "accept_probability",
    "build",
    "calibrate_threshold",
    "corpus",
    "decode",
    "early_exit",
    "encode",
    "exit_agreement",
    "greedy",
    "predicted_tokens_per_round",
    "prompts",
    "self_speculative",
    "speculative",
]

VOCAB = 256

#: The target: 8 layers, d = 128. See the README's decoding section for why these sizes.
TARGET_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 384,
    "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}
#: The draft: 1 layer, d = 128.
DRAFT_CONFIG: dict[str, Any] = {**TARGET_CONFIG, "num_hidden_layers": 1}


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    batch: int
    seq_len: int
    lr: float
    exit_loss: bool  # the early-exit loss on every layer (the target)


TARGET_TRAIN = TrainSpec(steps=520, batch=16, seq_len=128, lr=4e-3, exit_loss=True)
DRAFT_TRAIN = TrainSpec(steps=300, batch=16, seq_len=128, lr=4e-3, exit_loss=False)
#: Weight of the mean loss of the intermediate exits, next to the last layer's (weight 1).
EXIT_WEIGHT = 0.5
#: Bumped when the corpus, the recipe or the file layout changes (rebuilds old models).
BUILD_VERSION = 1
MARKER = ".decoding-built.json"
SEED = 0


# --------------------------------------------------------------------------------------
# bytes
# --------------------------------------------------------------------------------------


def encode(text: str) -> torch.Tensor:
    """``LongTensor[1, n]`` of the UTF-8 bytes of *text*."""
    return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """The text of byte tokens (invalid UTF-8 shown as U+FFFD)."""
    values = tokens.flatten().tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return bytes(values).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------
# the corpus: the standard library's .py files
# --------------------------------------------------------------------------------------


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py")
                  if not skip.intersection(p.relative_to(root).parts) and p.is_file())


def _held_out(path: Path) -> bool:
    """One file in 20 (by a hash of its name) is never trained on: prompts come from it."""
    return zlib.crc32(path.name.encode()) % 20 == 0


def corpus(held_out: bool = False) -> bytes:
    """The training text (or, with *held_out*, the text prompts are taken from)."""
    parts = []
    for path in _stdlib_files():
        if _held_out(path) == held_out:
            try:
                parts.append(path.read_bytes())
            except OSError:
                continue
    return b"\n".join(parts)


def prompts(count: int, length: int = 48, seed: int = 1) -> list[torch.Tensor]:
    """*count* prompts of *length* bytes from held-out files, each starting a line."""
    text = corpus(held_out=True)
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    while len(out) < count:
        start = int(torch.randint(0, len(text) - 4 * length, (1,), generator=gen))
        start = text.find(b"\n", start) + 1
        piece = text[start:start + length]
        if len(piece) == length and piece.strip() and piece.isascii():
            out.append(torch.tensor([list(piece)], dtype=torch.long))
    return out


# --------------------------------------------------------------------------------------
# the lean forward
# --------------------------------------------------------------------------------------


class KVCache:
    """Keys and values of every layer for one sequence, preallocated; ``length`` is how many
    positions are valid. :meth:`crop` is the rollback after a rejection."""

    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype) -> None:
        self.k = torch.zeros(layers, 1, heads, capacity, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def crop(self, length: int) -> None:
        """Forget every position from *length* on (the next write overwrites them)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length


@dataclass
class _Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    ln2: torch.Tensor
    wgu: torch.Tensor
    wdown: torch.Tensor


class Runner:
    """The Llama forward of a ``LlamaForCausalLM``, written out over its weights.

    Same math as the Hugging Face forward (RMSNorm, rotary embeddings from the model's
    own ``rotary_emb``, SDPA attention, SwiGLU MLP); q/k/v and gate/up are fused into one
    matmul each. ``depth`` keeps only the first layers (the self-speculative draft).
    Build one per decoding call: it reads the current weights, so edits to the model in
    a notebook are seen.
    """

    def __init__(self, model: Any, depth: int | None = None) -> None:
        cfg = model.config
        if getattr(cfg, "model_type", None) != "llama":
            raise ValueError(f"expected a LlamaForCausalLM, got {type(model).__name__} "
                             f"(model_type {getattr(cfg, 'model_type', None)!r})")
        if cfg.num_key_value_heads != cfg.num_attention_heads:
            raise ValueError("grouped-query attention is not supported: "
                             "num_key_value_heads must equal num_attention_heads")
        self.config = cfg
        self.vocab = int(cfg.vocab_size)
        self.heads = int(cfg.num_attention_heads)
        self.dim = int(cfg.hidden_size)
        self.head_dim = self.dim // self.heads
        self.eps = float(cfg.rms_norm_eps)
        inner = model.model
        layers = list(inner.layers)
        self.total_layers = len(layers)
        self.depth = self.total_layers if depth is None else depth
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.head = model.lm_head.weight
        self.dtype = self.embed.dtype
        self.layers = [
            _Layer(
                ln1=layer.input_layernorm.weight,
                wqkv=torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                layer.self_attn.v_proj.weight]),
                wo=layer.self_attn.o_proj.weight,
                ln2=layer.post_attention_layernorm.weight,
                wgu=torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
                wdown=layer.mlp.down_proj.weight,
            )
            for layer in layers[:self.depth]
        ]
        self._rotary = inner.rotary_emb
        self._cos = self._sin = torch.empty(0)

    def new_cache(self, capacity: int) -> KVCache:
        self._tables(capacity)
        return KVCache(self.depth, self.heads, self.head_dim, capacity, self.dtype)

    def _tables(self, length: int) -> None:
        if self._cos.shape[0] < length:
            pos = torch.arange(length).unsqueeze(0)
            probe = torch.zeros(1, dtype=self.dtype)
            cos, sin = self._rotary(probe, pos)
            self._cos, self._sin = cos[0], sin[0]  # [length, head_dim]

    # -- pieces -----------------------------------------------------------------------
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The shared LM head after the final norm, on any layer's hidden state."""
        return F.linear(F.rms_norm(h, (self.dim,), self.norm, self.eps), self.head)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def layer(self, i: int, x: torch.Tensor, start: int, cache: KVCache | None) -> torch.Tensor:
        """Layer *i* on hidden states ``x`` ``[B, T, d]`` at positions ``start..start+T``.

        With a cache, writes this layer's keys and values there and attends to everything
        before them (``cache.length`` is advanced by the caller, once for all layers).
        """
        w = self.layers[i]
        b, t, _ = x.shape
        h = F.rms_norm(x, (self.dim,), w.ln1, self.eps)
        qkv = F.linear(h, w.wqkv).view(b, t, 3, self.heads, self.head_dim).transpose(1, 3)
        q, k, v = qkv.unbind(2)  # [B, H, T, hd]
        cos, sin = self._cos[start:start + t], self._sin[start:start + t]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if cache is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        else:
            cache.k[i, :, :, start:start + t] = k
            cache.v[i, :, :, start:start + t] = v
            keys, values = cache.k[i, :, :, :start + t], cache.v[i, :, :, :start + t]
            if t == 1:
                attn = F.scaled_dot_product_attention(q, keys, values)
            elif start == 0:
                attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
            else:
                mask = torch.ones(t, start + t, dtype=torch.bool).tril(start)
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + F.linear(attn.transpose(1, 2).reshape(b, t, self.dim), w.wo)
        h = F.rms_norm(x, (self.dim,), w.ln2, self.eps)
        gate, up = F.linear(h, w.wgu).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w.wdown)

    def fill_kv(self, i: int, x: torch.Tensor, start: int, cache: KVCache) -> None:
        """Keys and values of layer *i* computed from ``x`` (the state of an earlier exit):
        what a token that left early leaves behind for later tokens to attend to."""
        w = self.layers[i]
        t = x.shape[1]
        h = F.rms_norm(x, (self.dim,), w.ln1, self.eps)
        kv = F.linear(h, w.wqkv[self.dim:]).view(1, t, 2, self.heads, self.head_dim)
        k, v = kv.transpose(1, 3).unbind(2)
        cos, sin = self._cos[start:start + t], self._sin[start:start + t]
        cache.k[i, :, :, start:start + t] = self._rope(k, cos, sin)
        cache.v[i, :, :, start:start + t] = v

    def forward(self, tokens: Sequence[int], cache: KVCache) -> torch.Tensor:
        """Logits ``[T, vocab]`` for *tokens* appended at ``cache.length`` (all layers)."""
        start = cache.length
        self._tables(start + len(tokens))
        x = self.embed[torch.tensor(tokens, dtype=torch.long)].unsqueeze(0)
        for i in range(self.depth):
            x = self.layer(i, x, start, cache)
        cache.length = start + len(tokens)
        return self.logits(x)[0]

    def hidden_states(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """The output of every layer for a batch ``ids`` ``[B, T]`` (no cache): training and
        calibration."""
        self._tables(ids.shape[1])
        x = self.embed[ids]
        out = []
        for i in range(self.depth):
            x = self.layer(i, x, 0, None)
            out.append(x)
        return out


# --------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------


def _check_ids(ids: torch.Tensor, n: int) -> list[int]:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 \
            or ids.shape[1] < 1 or ids.dtype != torch.long:
        raise ValueError("ids must be a LongTensor of shape [1, prompt_len] with prompt_len >= 1"
                         f", got {getattr(ids, 'dtype', type(ids))} of shape "
                         f"{list(getattr(ids, 'shape', []))}")
    if n < 1:
        raise ValueError(f"n (new tokens) must be >= 1, got {n}")
    return [int(t) for t in ids[0].tolist()]


def _check_k(k: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (draft tokens per round) must be an integer >= 1, got {k!r}")


# --------------------------------------------------------------------------------------
# greedy
# --------------------------------------------------------------------------------------


def _stats(**extra: Any) -> dict[str, Any]:
    return {"accepted": [], "proposed": [], "acceptance": [], "tokens_per_pass": [],
            "exit_layers": [], "target_passes": 0, "seconds": 0.0, **extra}


def greedy(target: Any, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """Plain greedy decoding of the target, one pass per token, with a KV cache.

    >>> tokens, stats = greedy(target, encode("import "), 16)
    """
    seq = _check_ids(ids, n)
    t0 = time.perf_counter()
    with torch.inference_mode():
        run = Runner(target)
        cache = run.new_cache(len(seq) + n)
        stats = _stats()
        out: list[int] = []
        pending = seq
        while True:
            logits = run.forward(pending, cache)[-1]
            stats["target_passes"] += 1
            stats["tokens_per_pass"].append(1)
            token = int(logits.argmax())
            out.append(token)
            if len(out) == n:
                break
            pending = [token]
    stats["seconds"] = time.perf_counter() - t0
    return torch.tensor(out, dtype=torch.long), stats


# --------------------------------------------------------------------------------------
# speculative decoding
# --------------------------------------------------------------------------------------


def accept_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The speculative-sampling acceptance rule: ``min(1, p(t) / q(t))`` for a draft token
    ``t`` with target probability ``p`` and draft probability ``q``. Edit it to try
    another rule; the test of the output distribution rejects a wrong one."""
    return torch.clamp(p / q, max=1.0)


def _speculate(target: Runner, draft: Runner, seq: list[int], n: int, k: int,
               temperature: float, generator: torch.Generator | None,
               stats: dict[str, Any]) -> list[int]:
    # Note [Cache invariant]
    # Both caches hold a prefix of ``seq + drafts``: everything but the tokens in
    # ``(seq + drafts)[cache.length:]``, which the next forward of that model feeds first.
    # After the verification, only ``seq`` (now including the accepted drafts and the
    # correction or bonus token) is valid: each cache is cropped to the part of it that is
    # still a prefix of ``seq`` minus its last token, which nobody has fed yet. The target
    # fed every draft, so it keeps ``len(seq) - 1``; the draft never fed its own last
    # proposal, so after a full acceptance it lags two tokens behind and catches up in one
    # two-token forward at the start of the next round.
    tcache = target.new_cache(len(seq) + n + k + 1)
    dcache = draft.new_cache(len(seq) + n + k + 1)
    produced = 0
    sampling = temperature > 0
    while produced < n:
        kk = min(k, n - produced - 1)  # the round commits at most kk + 1 tokens
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        for _ in range(kk):
            logits = draft.forward((seq + drafts)[dcache.length:], dcache)[-1]
            if sampling:
                q = torch.softmax(logits.float() / temperature, dim=-1)
                qs.append(q)
                drafts.append(int(torch.multinomial(q, 1, generator=generator)))
            else:
                drafts.append(int(logits.argmax()))
        scored = target.forward((seq + drafts)[tcache.length:], tcache)[-(kk + 1):]
        stats["target_passes"] += 1
        new: list[int] = []
        accepted = 0
        if sampling:
            ps = torch.softmax(scored.float() / temperature, dim=-1)
            for i, token in enumerate(drafts):
                u = torch.rand((), generator=generator)
                if bool(u < accept_probability(ps[i, token], qs[i][token])):
                    new.append(token)
                    accepted += 1
                    continue
                residual = torch.clamp(ps[i] - qs[i], min=0.0)
                total = residual.sum()
                dist = residual / total if float(total) > 0 else ps[i]
                new.append(int(torch.multinomial(dist, 1, generator=generator)))
                break
            else:
                new.append(int(torch.multinomial(ps[kk], 1, generator=generator)))
        else:
            best = scored.argmax(dim=-1).tolist()
            for i, token in enumerate(drafts):
                if best[i] != token:
                    break
                new.append(token)
            accepted = len(new)
            new.append(best[accepted])
        seq.extend(new)
        produced += len(new)
        tcache.crop(len(seq) - 1)
        dcache.crop(min(dcache.length, len(seq) - 1))
        stats["accepted"].append(accepted)
        stats["proposed"].append(kk)
        stats["acceptance"].append(accepted / kk if kk else None)
        stats["tokens_per_pass"].append(len(new))
    return seq


def _check_pair(target: Any, draft: Any) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"the draft's vocabulary ({dv} tokens) differs from the target's "
                         f"({tv} tokens): speculative decoding needs the same tokenizer")


def speculative(target: Any, draft: Any, ids: torch.Tensor, n: int, k: int,
                temperature: float = 0.0, *, generator: torch.Generator | None = None,
                ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Speculative decoding: *draft* proposes *k* tokens, *target* verifies them in one pass.

    ``temperature=0``: greedy verification (output identical to :func:`greedy`).
    ``temperature>0``: speculative sampling from ``softmax(logits / temperature)`` of the
    target, exactly (randomness from *generator*).

    ``stats``: ``accepted``/``proposed`` (draft tokens per round), ``acceptance`` (their
    ratio), ``tokens_per_pass`` (tokens committed per target pass), ``target_passes``,
    ``exit_layers`` (empty here), ``seconds``.

    >>> tokens, stats = speculative(target, draft, encode("def "), 64, k=4)
    """
    seq = _check_ids(ids, n)
    _check_k(k)
    _check_pair(target, draft)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    t0 = time.perf_counter()
    stats = _stats(k=k)
    with torch.inference_mode():
        out = _speculate(Runner(target), Runner(draft), seq, n, k, temperature, generator,
                         stats)
    stats["seconds"] = time.perf_counter() - t0
    return torch.tensor(out[-n:], dtype=torch.long), stats


def self_speculative(target: Any, ids: torch.Tensor, n: int, k: int, exit_layer: int,
                     ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Self-speculative decoding: the target's first *exit_layer* layers (with the shared
    head) draft *k* tokens greedily, the full target verifies. Exact like greedy.

    >>> tokens, stats = self_speculative(target, encode("class "), 64, k=4, exit_layer=2)
    """
    seq = _check_ids(ids, n)
    _check_k(k)
    layers = int(target.config.num_hidden_layers)
    if not isinstance(exit_layer, int) or not 1 <= exit_layer < layers:
        raise ValueError(f"exit_layer must be an integer in 1..{layers - 1} (the target has "
                         f"{layers} layers), got {exit_layer!r}")
    t0 = time.perf_counter()
    stats = _stats(k=k, exit_layers=[exit_layer])
    with torch.inference_mode():
        out = _speculate(Runner(target), Runner(target, depth=exit_layer), seq, n, k, 0.0,
                         None, stats)
    stats["seconds"] = time.perf_counter() - t0
    return torch.tensor(out[-n:], dtype=torch.long), stats


def predicted_tokens_per_round(alpha: float, k: int) -> float:
    """``(1 - alpha^(k+1)) / (1 - alpha)``: expected tokens per target pass when each draft
    token is accepted independently with probability *alpha*."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def acceptance_rate(stats: Sequence[dict[str, Any]]) -> float:
    """alpha from the rounds of speculative runs: each draft token checked is a trial and the
    checks of a round stop at the first rejection, so alpha = accepted / (accepted +
    rejections) (the maximum-likelihood estimate of a per-token acceptance probability)."""
    accepted = sum(sum(s["accepted"]) for s in stats)
    rejected = sum(a < p for s in stats
                   for a, p in zip(s["accepted"], s["proposed"], strict=True))
    return accepted / (accepted + rejected) if accepted + rejected else float("nan")


# --------------------------------------------------------------------------------------
# early exit
# --------------------------------------------------------------------------------------


def _thresholds(target: Any, thresholds: float | Sequence[float]) -> list[float]:
    layers = int(target.config.num_hidden_layers)
    if isinstance(thresholds, (int, float)):
        return [float(thresholds)] * (layers - 1)
    values = [float(t) for t in thresholds]
    if len(values) != layers - 1:
        raise ValueError(f"thresholds has {len(values)} values, but the target has {layers} "
                         f"layers: give {layers - 1} (one per exit after layers 1..{layers - 1}"
                         "; the last layer always answers) or a single float")
    return values


def early_exit(target: Any, ids: torch.Tensor, n: int, thresholds: float | Sequence[float],
               ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Greedy decoding that stops each token at the first layer whose max probability (the
    shared head after the final norm) reaches that layer's threshold.

    ``thresholds``: one per exit after layers ``1..L-1`` (or one float for all). The
    layers a token skipped still get its keys and values, computed from the exited state
    (CALM's state propagation), so later tokens can attend to it. ``stats["exit_layers"]``
    is the number of layers each token ran (``1..L``).

    >>> tokens, stats = early_exit(target, encode("for "), 64, 0.9)
    """
    seq = _check_ids(ids, n)
    limits = _thresholds(target, thresholds)
    t0 = time.perf_counter()
    stats = _stats()
    with torch.inference_mode():
        run = Runner(target)
        cache = run.new_cache(len(seq) + n)
        out = [int(run.forward(seq, cache)[-1].argmax())]  # the prompt runs every layer
        stats["exit_layers"].append(run.depth)
        stats["target_passes"] += 1
        while len(out) < n:
            start = cache.length
            x = run.embed[out[-1]].view(1, 1, -1)
            for i in range(run.depth):
                x = run.layer(i, x, start, cache)
                logits = run.logits(x)[0, 0]
                if i == run.depth - 1 or float(
                        torch.exp(logits.max() - torch.logsumexp(logits, 0))) >= limits[i]:
                    break
            for j in range(i + 1, run.depth):
                run.fill_kv(j, x, start, cache)
            cache.length = start + 1
            out.append(int(logits.argmax()))
            stats["exit_layers"].append(i + 1)
            stats["target_passes"] += 1
    stats["tokens_per_pass"] = [1] * len(out)
    stats["seconds"] = time.perf_counter() - t0
    return torch.tensor(out, dtype=torch.long), stats


def exit_agreement(target: Any, ids: torch.Tensor, tokens: torch.Tensor) -> float:
    """The fraction of *tokens* (generated after *ids*) equal to the full model's argmax
    given the same prefix (one teacher-forced pass of the full model)."""
    with torch.inference_mode():
        full = torch.cat([ids[0], tokens]).unsqueeze(0)
        run = Runner(target)
        logits = run.logits(run.hidden_states(full)[-1])[0]
        best = logits[ids.shape[1] - 1:-1].argmax(-1)
    return float((best == tokens).float().mean())


def calibrate_threshold(target: Any, calibration: Sequence[torch.Tensor], n: int,
                        agreement: float = 0.95,
                        grid: Sequence[float] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9,
                                                 0.95, 0.98, 0.99, 0.995),
                        ) -> tuple[float, float]:
    """The lowest threshold of *grid* (one for every exit) at which :func:`early_exit`
    agrees with the full model on at least *agreement* of the tokens it generates after
    the *calibration* prompts (*n* each), and that agreement. Scans from the top and stops
    at the first threshold that falls short."""
    chosen = (1.0, 1.0)
    for t in sorted(grid, reverse=True):
        hits = total = 0.0
        for ids in calibration:
            tokens, _ = early_exit(target, ids, n, t)
            hits += exit_agreement(target, ids, tokens) * n
            total += n
        if hits / total < agreement:
            break
        chosen = (t, hits / total)
    return chosen


# --------------------------------------------------------------------------------------
# building: train once, atomically
# --------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"decoding: {message}", file=sys.stderr, flush=True)


def _batches(data: torch.Tensor, spec: TrainSpec, gen: torch.Generator) -> Iterator[torch.Tensor]:
    offsets = torch.arange(spec.seq_len + 1)
    while True:
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch, 1), generator=gen)
        yield data[starts + offsets].long()


def _loss(model: Any, batch: torch.Tensor, exit_loss: bool) -> tuple[torch.Tensor, list[float]]:
    """Next-byte cross-entropy of the last layer, plus, with *exit_loss*, :data:`EXIT_WEIGHT`
    times the mean over the intermediate exits (shared head after the final norm) of
    theirs. Returns the loss and every exit's cross-entropy."""
    run = Runner(model)
    inputs, labels = batch[:, :-1], batch[:, 1:].reshape(-1)
    states = run.hidden_states(inputs)
    chosen = states if exit_loss else states[-1:]
    losses = [F.cross_entropy(run.logits(h).reshape(-1, run.vocab), labels) for h in chosen]
    total = losses[-1] + (EXIT_WEIGHT * torch.stack(losses[:-1]).mean() if len(losses) > 1 else 0)
    return total, [float(x.detach()) for x in losses]


def train(model: Any, spec: TrainSpec, data: torch.Tensor, seed: int = SEED,
          log_every: int = 50) -> dict[str, Any]:
    """AdamW with warm-up and cosine decay on random windows of *data*; returns the
    losses (last-layer loss averaged over the last 50 steps, and per exit)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    warmup = max(1, spec.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return spec.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, spec.steps - warmup)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    # Note [One thread]
    # On a shared 2-core machine, two OpenMP threads wait for each other whenever another
    # process holds a core: a step took 3-4x longer than with one thread in our runs. One
    # thread is also reproducible (same losses on every run).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_steps(model, spec, data, gen, opt, lr_at, log_every)
    finally:
        torch.set_num_threads(threads)
        model.eval()


def _train_steps(model: Any, spec: TrainSpec, data: torch.Tensor, gen: torch.Generator,
                 opt: torch.optim.Optimizer, lr_at: Callable[[int], float],
                 log_every: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    recent: list[list[float]] = []
    batches = _batches(data, spec, gen)
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss, parts = _loss(model, next(batches), spec.exit_loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [parts])[-50:]
        if log_every and (step + 1) % log_every == 0:
            _log(f"step {step + 1}/{spec.steps}: loss {parts[-1]:.3f} "
                 f"({time.perf_counter() - t0:.0f} s)")
    per_exit = [sum(r[i] for r in recent) / len(recent) for i in range(len(recent[0]))]
    return {"seconds": time.perf_counter() - t0, "final_loss": per_exit[-1],
            "exit_losses": per_exit, "steps": spec.steps}


def _eval_loss(model: Any, data: torch.Tensor, exit_loss: bool) -> list[float]:
    gen = torch.Generator().manual_seed(SEED + 7)
    spec = TrainSpec(steps=0, batch=32, seq_len=128, lr=0, exit_loss=exit_loss)
    with torch.inference_mode():
        return _loss(model, next(_batches(data, spec, gen)), exit_loss)[1]


def _spec(name: str, config: dict[str, Any], recipe: TrainSpec) -> dict[str, Any]:
    return {"name": name, "version": BUILD_VERSION, "config": config,
            "train": recipe.__dict__, "exit_weight": EXIT_WEIGHT if recipe.exit_loss else None,
            "seed": SEED, "python": sys.version.split()[0],
            "transformers": _version("transformers"), "torch": torch.__version__}


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def read_marker(path: Path) -> dict[str, Any] | None:
    """The build record of a finished model directory (``None`` if unfinished)."""
    try:
        return dict(json.loads((path / MARKER).read_text()))
    except (OSError, ValueError):
        return None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _build_one(path: Path, spec: dict[str, Any], write: Callable[[Path], dict[str, Any]],
               ) -> Path:
    # Note [Atomic build]
    # A directory counts as built only when its marker (written last) records the same
    # spec. The model is trained and saved into a private ``.<name>.partial`` sibling and
    # renamed into place, under a lock, so a crash or ^C never leaves a directory that
    # looks finished, and two processes never train the same model at once.
    def done() -> bool:
        marker = read_marker(path)
        return marker is not None and marker.get("spec") == spec

    if done():
        return path
    with _locked(path):
        if done():
            return path
        partial = path.parent / f".{path.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        record = write(partial)
        (partial / MARKER).write_text(json.dumps({"spec": spec, **record}, indent=1))
        if path.exists():
            if read_marker(path) is None and any(path.iterdir()):
                raise FileExistsError(f"{path} exists and was not built by decoding.build(); "
                                      "remove it or choose another models directory")
            shutil.rmtree(path)
        os.rename(partial, path)
    return path


def _writer(config: dict[str, Any], recipe: TrainSpec, seed: int,
            ) -> Callable[[Path], dict[str, Any]]:
    def write(out: Path) -> dict[str, Any]:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**config))
        params = sum(p.numel() for p in model.parameters())
        _log(f"training {out.name.strip('.').removesuffix('.partial')}: {params / 1e6:.2f}M "
             f"parameters, {recipe.steps} steps of {recipe.batch}x{recipe.seq_len} bytes")
        data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
        record = train(model, recipe, data, seed)
        held = torch.frombuffer(bytearray(corpus(held_out=True)), dtype=torch.uint8)
        record["held_out_losses"] = _eval_loss(model, held, recipe.exit_loss)
        record["parameters"] = params
        model.save_pretrained(out)
        _log(f"trained in {record['seconds']:.0f} s: loss {record['final_loss']:.3f} "
             f"(held out {record['held_out_losses'][-1]:.3f} nats/byte)")
        return record

    return write


def build(models_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Train (once) and save the target and the draft under *models_dir*; returns
    ``(target_dir, draft_dir)``. Later calls find the finished directories and return at
    once. Training takes a few minutes on two cores."""
    root = Path(models_dir).expanduser().absolute()
    target = _build_one(root / "decoding-target", _spec("target", TARGET_CONFIG, TARGET_TRAIN),
                        _writer(TARGET_CONFIG, TARGET_TRAIN, SEED))
    draft = _build_one(root / "decoding-draft", _spec("draft", DRAFT_CONFIG, DRAFT_TRAIN),
                       _writer(DRAFT_CONFIG, DRAFT_TRAIN, SEED + 1))
    return target, draft
