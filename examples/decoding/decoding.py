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
and return ``(tokens, stats)``: ``tokens`` is a 1-D ``LongTensor`` of the new tokens (``n``,
or fewer when a stop token ended the sequence: ``stop=``, by default the model's
end-of-sequence ids as in transformers' ``generate``) and ``stats`` a dict (see
:func:`speculative`). ``ids`` may also be a list of prompts of any lengths: they run as
one batch (each row at its own positions in one KV cache) and the result is a list of
``(tokens, stats)``, one per prompt, each equal to running that prompt alone.

- :func:`greedy`: one target pass per token.
- :func:`speculative`: the draft proposes ``k`` tokens, the target scores them in one
  pass. ``temperature=0`` accepts the longest prefix equal to the target's argmax (the
  output equals :func:`greedy` token for token); ``temperature>0`` is speculative
  sampling (accept with :func:`accept_probability`, resample a rejection from the
  residual ``max(p - q, 0)``), whose output follows the target's distribution exactly.
- :func:`early_exit`: the shared LM head after the final norm on every layer; a token
  leaves at the first layer whose max probability clears its threshold.
- :func:`self_speculative`: the target's first ``exit_layer`` layers are the draft, the
  rest of the target verifies, on one KV cache (the draft's early layers are the
  target's); greedy or sampling, exact like :func:`speculative`.
- :func:`prompt_lookup`: no draft model; the drafts are what followed the last earlier
  occurrence of the sequence's final n-gram.

:func:`speculative` and :func:`self_speculative` also draft adaptively: with
``confidence=``, a round's drafting stops after a token the draft is less sure of.

The lean forward (:class:`Runner`) runs any ``LlamaForCausalLM``: biases, grouped-query
attention, ``head_dim``, the rope scaling types, tied embeddings; what it cannot run
raises ``ValueError`` naming the option.

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
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

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
    "prompt_lookup",
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
    distill: bool = False  # learn the target's next-byte distributions (the draft)


TARGET_TRAIN = TrainSpec(steps=520, batch=16, seq_len=128, lr=4e-3, exit_loss=True)
# Note [A distilled draft]
# Speculation gains what the draft agrees with the target, not what it predicts of the
# text. A draft trained on the bytes (300 steps, 15 s) was accepted on about half of its
# proposals at K = 4 (accepted / proposed on 12 held-out prompts), and a 5x longer run on
# the bytes barely more (0.50). The same draft trained on the target's own next-byte
# distributions over the same text (KL(target || draft), the target frozen) was accepted
# on 0.94 of them after 600 steps (88 s) and on 0.97 after 1200 (176 s; the argmax agreed
# with the target's on 85% of held-out text against 60% for the first): on its own greedy
# continuations the target's choice is what a 1-layer model can learn to copy. The bytes
# reach the draft only through the target.
DRAFT_TRAIN = TrainSpec(steps=1200, batch=16, seq_len=128, lr=4e-3, exit_loss=False,
                        distill=True)
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

#: Rope types whose tables transformers recomputes from the sequence length during a
#: forward (``dynamic_rope_update``); the lean forward runs them only as far as the
#: original length, where their tables are the fixed ones (Note [Rope tables]).
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
#: The largest first-layer table a draft keeps (Note [A draft's first layer by token]).
FIRST_TABLE_BYTES = 16 << 20


class KVCache:
    """Keys and values of every layer for a batch of sequences, preallocated (``[layers,
    batch, kv_heads, capacity, head_dim]``). ``length`` is how many positions are valid in
    a single-sequence cache; the batched decoders keep one length per row themselves.
    :meth:`crop` is the rollback after a rejection."""

    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, batch: int = 1) -> None:
        self.k = torch.zeros(layers, batch, heads, capacity, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        # one view per layer, made once: selecting the layer on every step costs an operation
        self.keys = list(self.k.unbind(0))
        self.values = list(self.v.unbind(0))
        self.length = 0

    @property
    def capacity(self) -> int:
        return int(self.k.shape[3])

    def crop(self, length: int) -> None:
        """Forget every position from *length* on (the next write overwrites them)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length


@dataclass
class _Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    wgu: torch.Tensor
    bgu: torch.Tensor | None
    wdown: torch.Tensor
    bdown: torch.Tensor | None


def _cat_bias(*linears: Any) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
                      for b, lin in zip(biases, linears, strict=True)])


@dataclass
class _At:
    """Where one forward's inputs sit, computed once for all its layers: the rope factors
    (``[T, qk]``, or ``[B, T, qk]`` per row), the attention mask (``None``: none or causal)
    and, for ragged rows, their positions (Note [Ragged rows])."""

    start: int | torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    pos: torch.Tensor | None = None
    rows: torch.Tensor | None = None


class _Prepared:
    """What a :class:`Runner` builds from a model's weights, kept between decoding calls
    (Note [Prepared once]): the fused layers, the rope tables and the mask table."""

    def __init__(self, key: list[tuple[Any, int, int]], layers: list[_Layer]) -> None:
        self.key = key
        self.layers = layers
        self.cos = self.sin = torch.empty(0)      # [positions, head_dim]
        self.cosz = self.sinz = torch.empty(0)    # [positions, (heads + kv_heads) * head_dim]
        self.tri = torch.empty(0, 0)              # Note [One mask per forward]
        self.capacity = 0
        self.first: torch.Tensor | None = None    # Note [A draft's first layer by token]
        self.ranking_head: torch.Tensor | None = None  # the LM head times the final norm


#: model -> its prepared weights (dropped with the model).
_PREPARED: weakref.WeakKeyDictionary[Any, _Prepared] = weakref.WeakKeyDictionary()


class Runner:
    """The Llama forward of a ``LlamaForCausalLM``, written out over its weights.

    Same math as the Hugging Face forward: RMSNorm, rotary embeddings from the model's
    own ``rotary_emb`` (every rope type transformers has for Llama), SDPA attention with
    grouped-query heads and any ``head_dim``, the biases of ``attention_bias`` and
    ``mlp_bias``, the MLP's own activation, tied or untied embeddings. q/k/v and gate/up
    are fused into one matmul each. ``depth`` keeps only the first layers (the
    self-speculative draft). What it cannot run raises ``ValueError`` naming the option.
    Build one per decoding call: it reads the current weights, so edits to the model in
    a notebook are seen (Note [Prepared once]).
    """

    def __init__(self, model: Any, depth: int | None = None) -> None:
        cfg = model.config
        if getattr(cfg, "model_type", None) != "llama":
            raise ValueError(f"expected a LlamaForCausalLM, got {type(model).__name__} "
                             f"(model_type {getattr(cfg, 'model_type', None)!r})")
        self.config = cfg
        self.vocab = int(cfg.vocab_size)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"num_attention_heads ({self.heads}) must be a multiple of "
                             f"num_key_value_heads ({self.kv_heads})")
        self.dim = int(cfg.hidden_size)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.dim // self.heads)
        self.eps = float(cfg.rms_norm_eps)
        inner = model.model
        layers = list(inner.layers)
        self.total_layers = len(layers)
        self.depth = self.total_layers if depth is None else depth
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.head = model.lm_head.weight
        self.head_bias = getattr(model.lm_head, "bias", None)
        self.dtype = self.embed.dtype
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qk_size = self.q_size + self.kv_size
        self.qkv_size = self.qk_size + self.kv_size
        self.gqa = self.kv_heads != self.heads
        act = getattr(cfg, "hidden_act", "silu")
        self.act: Callable[[torch.Tensor], torch.Tensor] = (
            F.silu if act == "silu" else layers[0].mlp.act_fn if layers else F.silu)
        self._rotary = inner.rotary_emb
        self.rope_type = str(getattr(self._rotary, "rope_type", "default"))
        self._rope_limit: int | None = None
        if self.rope_type in _LENGTH_DEPENDENT_ROPE:
            params = getattr(cfg, "rope_parameters", None) or {}
            self._rope_limit = int(
                cfg.max_position_embeddings if self.rope_type == "dynamic"
                else params.get("original_max_position_embeddings")
                or cfg.max_position_embeddings)
        self._prep = self._prepare(model, layers)
        self.layers = self._prep.layers[:self.depth]
        self.inter = int(self.layers[0].wdown.shape[1]) if self.layers else 0

    def _prepare(self, model: Any, layers: list[Any]) -> _Prepared:
        # Note [Prepared once]
        # Fusing the weights (and the rope and mask tables) costs about half a target step
        # per decoding call: a fixed price per call, paid by greedy and speculative alike.
        # Outside autograd the result is kept per model and reused while every tensor it
        # was built from is the same object with the same version counter, storage and
        # dtype: an in-place edit (``with torch.no_grad(): w.mul_(2)``,
        # ``load_state_dict``), a new Parameter, ``model.to(dtype)`` all rebuild it.
        # Training (grad enabled) always builds afresh, so that gradients reach the
        # model's own parameters.
        sources: list[torch.Tensor] = [self.embed, self.norm, self.head]
        if self.head_bias is not None:
            sources.append(self.head_bias)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                        mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                sources.append(lin.weight)
                if lin.bias is not None:
                    sources.append(lin.bias)
            sources += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        inv = getattr(self._rotary, "inv_freq", None)
        if isinstance(inv, torch.Tensor):
            sources.append(inv)
        key = [(t, t._version, t.data_ptr(), t.dtype) for t in sources]
        caching = not torch.is_grad_enabled()
        if caching:
            kept = _PREPARED.get(model)
            if kept is not None and len(kept.key) == len(key) and all(
                    a[0] is b[0] and a[1:] == b[1:] for a, b in zip(kept.key, key, strict=True)):
                return kept
        built = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            built.append(_Layer(
                ln1=layer.input_layernorm.weight,
                wqkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                bqkv=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                wo=attn.o_proj.weight, bo=attn.o_proj.bias,
                ln2=layer.post_attention_layernorm.weight,
                wgu=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                bgu=_cat_bias(mlp.gate_proj, mlp.up_proj),
                wdown=mlp.down_proj.weight, bdown=mlp.down_proj.bias))
        prep = _Prepared(key, built)
        if caching:
            _PREPARED[model] = prep
        return prep

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        self._tables(capacity)
        self._prep.capacity = max(self._prep.capacity, capacity)
        return KVCache(self.depth, self.kv_heads, self.head_dim, capacity, self.dtype, batch)

    def check_length(self, positions: int) -> None:
        """Refuse a run over more *positions* than the model's rope runs exactly."""
        # Note [Rope tables]
        # cos/sin are computed once per Runner for every position a cache can hold, from
        # the model's own rotary module (its inv_freq and attention scaling: linear, yarn,
        # llama3 ... are transformers' own), the same expression as its forward, without
        # calling it (which would change the state of the two types below). Two types
        # recompute their frequencies from the length of the sequence during a forward:
        # "dynamic" grows them past max_position_embeddings and "longrope" switches to its
        # long factors past original_max_position_embeddings. Up to that length both use
        # their original table; past it transformers' cached keys were rotated with the
        # frequencies of the length at the time they were computed, which no fixed table
        # reproduces (nor any method that scores several positions at once), so the lean
        # forward refuses it.
        if self._rope_limit is not None and positions > self._rope_limit:
            raise ValueError(
                f"rope_type {self.rope_type!r} changes its frequencies past "
                f"{self._rope_limit} positions (max_position_embeddings / "
                f"original_max_position_embeddings), and this run needs {positions}: the "
                "lean forward runs it only up to that length")

    @property
    def _cos(self) -> torch.Tensor:
        return self._prep.cos

    @property
    def _sin(self) -> torch.Tensor:
        return self._prep.sin

    def _tables(self, length: int) -> None:
        prep = self._prep
        if prep.cos.shape[0] >= length:
            return
        length = max(length, 2 * prep.cos.shape[0])  # grow geometrically
        rot = self._rotary
        inv = getattr(rot, "original_inv_freq", None) if self._rope_limit is not None else None
        inv = getattr(rot, "inv_freq", None) if inv is None else inv
        pos = torch.arange(length).unsqueeze(0)
        if inv is None:  # not transformers' rotary module: ask it
            cos, sin = rot(torch.zeros(1, dtype=self.dtype), pos)
        else:  # LlamaRotaryEmbedding.forward, as written there
            freqs = pos[..., None].float() * inv.float()
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = getattr(rot, "attention_scaling", 1.0)
            cos, sin = (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)
        prep.cos, prep.sin = cos[0], sin[0]  # [length, head_dim]
        # the factors for every head of q and k side by side, [length, qk_size]; sin with
        # the sign of rotate_half folded in (Note [Rope with one roll])
        tiles = self.heads + self.kv_heads
        half = self.head_dim // 2
        sign = torch.ones(self.head_dim, dtype=self.dtype)
        sign[:half] = -1
        prep.cosz, prep.sinz = prep.cos.repeat(1, tiles), (prep.sin * sign).repeat(1, tiles)

    def _mask(self, start: int, t: int) -> torch.Tensor:
        """The additive mask of *t* queries at ``start..start+t`` over keys ``0..start+t``:
        cut from one table (Note [One mask per forward])."""
        prep = self._prep
        rows, width = prep.tri.shape
        if t > rows or start > width - rows:
            rows = max(t, rows, 16)
            width = rows + max(start, prep.capacity, width - rows)
            allowed = torch.ones(rows, width, dtype=torch.bool).tril(width - rows)
            prep.tri = torch.zeros(rows, width, dtype=self.dtype).masked_fill_(
                ~allowed, float("-inf"))
        # contiguous: SDPA copies a strided mask on every call (once here serves 8 layers)
        return prep.tri[:t, width - rows - start:width - rows + t].contiguous()

    def at(self, start: int | torch.Tensor, t: int) -> _At:
        """Positions ``start..start+t`` (one start for every row, or a ``LongTensor[B]``,
        one per row): what every layer of one forward needs of them."""
        # Note [One mask per forward]
        # A layer used to build its causal mask (and slice its rope factors) itself: eight
        # times per target pass, and a boolean mask, which SDPA converts to an additive one
        # on every call (twice the time of an additive mask for a 5-token verification).
        # Now one forward computes them once (this object) and the layers share them. For a
        # single sequence the additive mask of queries start..start+t is a view of a table
        # ``tri`` (R rows, W columns, ``tri[j, c] = 0`` where ``c <= W - R + j``, else
        # -inf): its rows :t and columns ``W - R - start .. W - R + t`` are exactly
        # "key c is visible to query j iff c <= start + j", one copy and no arithmetic. A
        # single token needs no mask, a prompt at position 0 is SDPA's ``is_causal``.
        self._tables((int(start) if isinstance(start, int) else int(start.max())) + t)
        if isinstance(start, int):
            cos, sin = self._prep.cosz[start:start + t], self._prep.sinz[start:start + t]
            if t == 1:
                return _At(start, cos, sin, None, False)
            if start == 0:
                return _At(start, cos, sin, None, True)
            return _At(start, cos, sin, self._mask(start, t), False)
        pos = start[:, None] + torch.arange(t)  # [B, T]
        span = int(pos.max()) + 1
        hidden = torch.arange(span)[None, None, :] > pos[:, :, None]  # [B, T, span]
        mask = torch.zeros(hidden.shape, dtype=self.dtype).masked_fill_(hidden, float("-inf"))
        return _At(start, self._prep.cosz[pos], self._prep.sinz[pos], mask.unsqueeze(1), False,
                   pos, torch.arange(start.shape[0])[:, None])

    # -- pieces -----------------------------------------------------------------------
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The shared LM head after the final norm, on any layer's hidden state."""
        return F.linear(F.rms_norm(h, (self.dim,), self.norm, self.eps), self.head,
                        self.head_bias)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, w: _Layer, x: torch.Tensor,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        h = F.rms_norm(x, (self.dim,), w.ln1, self.eps)
        qkv = F.linear(h, w.wqkv, w.bqkv)
        if self.kv_heads == self.heads:  # fewer operations: they are what a step costs
            q, k, v = qkv.view(b, t, 3, self.heads, self.head_dim).transpose(1, 3).unbind(2)
            return q, k, v
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(b, t, self.heads, self.head_dim).transpose(1, 2),
                k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2),
                v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2))

    def _roped(self, w: _Layer, x: torch.Tensor, at: _At, z: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v of layer weights *w* for ``x`` ``[B, T, d]``: ``[B, H, T, hd]``,
        ``[B, KV, T, hd]`` x2."""
        # Note [Rope with one roll]
        # transformers rotates q and k each as q*cos + rotate_half(q)*sin, rotate_half(q)
        # being [-q2, q1] per head: a slice, a negation, a concatenation and three
        # products, twice per layer. Here q and k are rotated together, as the first
        # qk_size columns of the fused projection: rotate_half of every head is a roll by
        # head_dim/2 within the head with the first half negated, and the negation is
        # folded into the sin table (``sinz``: -sin on each head's first half), so the rope
        # is one roll, one product and one fused multiply-add against tables tiled over the
        # heads. Negation is exact; the fused multiply-add rounds once where transformers
        # rounds twice (the tests compare logits at 1e-4).
        b, t, _ = x.shape
        hd = self.head_dim
        if z is None:
            z = F.linear(F.rms_norm(x, (self.dim,), w.ln1, self.eps), w.wqkv, w.bqkv)
        qk = z[..., :self.qk_size]
        rolled = torch.roll(qk.view(b, t, self.heads + self.kv_heads, hd), hd // 2, -1)
        qk = torch.addcmul(qk * at.cos, rolled.view(b, t, self.qk_size), at.sin)
        return (qk[..., :self.q_size].view(b, t, self.heads, hd).transpose(1, 2),
                qk[..., self.q_size:].view(b, t, self.kv_heads, hd).transpose(1, 2),
                z[..., self.qk_size:self.qkv_size].view(b, t, self.kv_heads, hd).transpose(1, 2))

    def _store(self, i: int, k: torch.Tensor, v: torch.Tensor, at: _At, cache: KVCache,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer *i*'s keys and values at *at*; returns the cached keys and values
        attention reads (up to the last position written)."""
        b, _, t, _ = k.shape
        keys, values = cache.keys[i], cache.values[i]
        if keys.shape[0] != b:
            keys, values = keys[:b], values[:b]
        if at.pos is None:
            start = int(at.start)
            keys.narrow(2, start, t).copy_(k)
            values.narrow(2, start, t).copy_(v)
            return keys.narrow(2, 0, start + t), values.narrow(2, 0, start + t)
        # Note [Ragged rows]
        # Rows of a batch sit at their own positions: row r's T inputs are positions
        # start[r]..start[r]+T, written to its cache there, and attend to its
        # positions up to their own. A row with fewer real inputs than T is padded;
        # the padding writes keys past the row's length, which nothing attends to
        # before a real input overwrites them (positions are only ever read below
        # the row's length or at the query's own position).
        keys[at.rows, :, at.pos] = k.transpose(1, 2)
        values[at.rows, :, at.pos] = v.transpose(1, 2)
        span = at.mask.shape[-1] if at.mask is not None else int(at.pos.max()) + 1
        return keys[:, :, :span], values[:, :, :span]

    def layer(self, i: int, x: torch.Tensor, start: int | torch.Tensor,
              cache: KVCache | None, at: _At | None = None, z: torch.Tensor | None = None,
              ) -> torch.Tensor:
        """Layer *i* on hidden states ``x`` ``[B, T, d]`` at positions ``start..start+T``
        (*start* an ``int`` for every row, or a ``LongTensor[B]``, one per row; *at*: what
        :meth:`at` computed of them, shared by the layers of one forward; *z*: the layer's
        q/k/v projection of ``x`` when known already, before the rope).

        With a cache, writes this layer's keys and values there and attends to everything
        before them in the row (the caller keeps the lengths).
        """
        w = self.layers[i]
        b, t, _ = x.shape
        if cache is None:  # training and calibration: a whole sequence from position 0
            q, k, v = self._qkv(w, x)  # [B, H, T, hd], [B, KV, T, hd] x2
            cos, sin = self._prep.cos[:t], self._prep.sin[:t]
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1,
                                                  enable_gqa=self.gqa)
        else:
            if at is None:
                at = self.at(start, t)
            q, k, v = self._roped(w, x, at, z)
            keys, values = self._store(i, k, v, at, cache)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=at.mask,
                                                  is_causal=at.causal, enable_gqa=self.gqa)
        x = x + F.linear(attn.transpose(1, 2).reshape(b, t, self.q_size), w.wo, w.bo)
        h = F.rms_norm(x, (self.dim,), w.ln2, self.eps)
        gu = F.linear(h, w.wgu, w.bgu)
        return x + F.linear(self.act(gu[..., :self.inter]) * gu[..., self.inter:],
                            w.wdown, w.bdown)

    def fill_kv(self, i: int, x: torch.Tensor, start: int | torch.Tensor,
                cache: KVCache, at: _At | None = None) -> None:
        """Keys and values of layer *i* computed from ``x`` (the state of an earlier exit):
        what a token that left early leaves behind for later tokens to attend to."""
        if at is None:
            at = self.at(start, x.shape[1])
        _, k, v = self._roped(self.layers[i], x, at)  # what layer() computes from this state
        self._store(i, k, v, at, cache)

    def embed_tokens(self, tokens: Sequence[int], table: torch.Tensor | None = None,
                     ) -> torch.Tensor:
        """Embeddings ``[T, d]`` of *tokens* (one token: a view, no index tensor), or
        their rows of another per-token *table*."""
        table = self.embed if table is None else table
        if len(tokens) == 1:
            return table[tokens[0], None]
        return F.embedding(torch.tensor(tokens, dtype=torch.long), table)

    def forward(self, tokens: Sequence[int], cache: KVCache) -> torch.Tensor:
        """Logits ``[T, vocab]`` for *tokens* appended at ``cache.length`` (all layers,
        one sequence)."""
        start = cache.length
        x = self.embed_tokens(tokens).unsqueeze(0)
        at = self.at(start, len(tokens))
        for i in range(self.depth):
            x = self.layer(i, x, start, cache, at)
        cache.length = start + len(tokens)
        return self.logits(x)[0]

    def draft_step(self, tokens: Sequence[int], start: int, cache: KVCache,
                   ranking: bool = False) -> torch.Tensor:
        """Logits ``[1, vocab]`` after *tokens* at positions ``start..`` of a one-row cache:
        a draft's step, its first layer's projection looked up by token (Note [A draft's
        first layer by token]). Not for the target: its numbers differ in the last bits.

        *ranking*: only their order is wanted (a greedy draft's argmax), and they may come
        scaled by a positive factor: the final norm's ``1 / rms`` is left out, its weight
        folded into the head."""
        # Note [A draft's first layer by token]
        # The first layer's q/k/v projection of a token, linear(rms_norm(embedding)),
        # depends on the token only: a draft looks it up in a [vocab, qkv] table computed
        # once per prepared model (while it is at most FIRST_TABLE_BYTES), which saves two
        # of a draft step's ~40 operations. A table row is computed in a batch of all the
        # tokens, so it may differ from the one-token product in the last bits: harmless
        # for a draft, whose numbers only decide what it proposes (the target's
        # verification makes the output exact, and speculative sampling reads the draft's
        # probabilities from these same logits), but not for the target, which greedy and
        # transformers must match token for token.
        prep = self._prep
        x = self.embed_tokens(tokens).unsqueeze(0)
        at = self.at(start, len(tokens))
        z = None
        if self.layers:
            table = prep.first
            if table is None and self.vocab * self.qkv_size * self.dtype.itemsize <= \
                    FIRST_TABLE_BYTES:
                w = self.layers[0]
                table = prep.first = F.linear(F.rms_norm(self.embed, (self.dim,), w.ln1,
                                                         self.eps), w.wqkv, w.bqkv)
            if table is not None:
                z = self.embed_tokens(tokens, table).unsqueeze(0)
        for i in range(self.depth):
            x = self.layer(i, x, start, cache, at, z if i == 0 else None)
        if ranking and self.head_bias is None:
            head = prep.ranking_head
            if head is None:
                head = prep.ranking_head = self.head * self.norm
            return F.linear(x[0, -1:], head)
        return self.logits(x[0, -1:])

    def run_rows(self, x: torch.Tensor, starts: Sequence[int], cache: KVCache,
                 lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Layers ``lo..hi`` on ``x`` ``[B, T, d]`` (row r at positions ``starts[r]..``,
        padded past its own inputs: Note [Ragged rows]); returns the output states."""
        first = starts[0]
        start: int | torch.Tensor = first if len(starts) == 1 or all(
            s == first for s in starts) else torch.tensor(starts, dtype=torch.long)
        at = self.at(start, x.shape[1])
        for i in range(lo, self.depth if hi is None else hi):
            x = self.layer(i, x, start, cache, at)
        return x

    def embed_rows(self, chunks: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
        """Embeddings ``[B, T, d]`` of ragged token lists, each padded with its last token
        to the longest, and each row's number of real inputs."""
        if len(chunks) == 1:
            return self.embed_tokens(chunks[0]).unsqueeze(0), [len(chunks[0])]
        widths = [len(c) for c in chunks]
        t = max(widths)
        padded = [list(c) + [c[-1] if c else 0] * (t - len(c)) for c in chunks]
        return F.embedding(torch.tensor(padded, dtype=torch.long), self.embed), widths

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

#: What every decoding function takes as ``ids``: one prompt, or a list of them.
Prompts = torch.Tensor | Sequence[torch.Tensor]
#: What it returns for one prompt; a list of prompts gets a list of these.
Result = tuple[torch.Tensor, dict[str, Any]]


def _check_ids(ids: torch.Tensor, n: int) -> list[int]:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 \
            or ids.shape[1] < 1 or ids.dtype != torch.long:
        raise ValueError("ids must be a LongTensor of shape [1, prompt_len] with prompt_len >= 1"
                         " (or a list of them)"
                         f", got {getattr(ids, 'dtype', type(ids))} of shape "
                         f"{list(getattr(ids, 'shape', []))}")
    if n < 1:
        raise ValueError(f"n (new tokens) must be >= 1, got {n}")
    return [int(t) for t in ids[0].tolist()]


def _check_prompts(ids: Prompts, n: int) -> tuple[list[list[int]], bool]:
    """The prompts as token lists, and whether a single one was given."""
    if isinstance(ids, (list, tuple)):
        if not ids:
            raise ValueError("ids is an empty list: give at least one prompt")
        return [_check_ids(x, n) for x in ids], False
    return [_check_ids(cast(torch.Tensor, ids), n)], True


def _check_stop(stop: Iterable[int] | int | None, model: Any) -> frozenset[int]:
    """The stop token ids: *stop*, or by default the model's end-of-sequence ids (its
    ``generation_config.eos_token_id``, what transformers' ``generate`` stops at; none
    for the byte-level pair). ``stop=()`` never stops early."""
    if stop is None:
        gen = getattr(model, "generation_config", None)
        stop = getattr(gen, "eos_token_id", None)
        if stop is None:
            stop = getattr(model.config, "eos_token_id", None)
        if stop is None:
            return frozenset()
    if isinstance(stop, int):
        return frozenset([stop])
    return frozenset(int(t) for t in stop)


def _check_k(k: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (draft tokens per round) must be an integer >= 1, got {k!r}")


def _check_temperature(temperature: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")


def _check_confidence(confidence: float | None) -> None:
    if confidence is not None and not 0 <= confidence <= 1:
        raise ValueError(f"confidence must be in [0, 1] (or None: always draft k), "
                         f"got {confidence}")


def _stats(**extra: Any) -> dict[str, Any]:
    return {"accepted": [], "proposed": [], "acceptance": [], "tokens_per_pass": [],
            "exit_layers": [], "target_passes": 0, "seconds": 0.0, **extra}


def _results(single: bool, outs: list[list[int]], stats: list[dict[str, Any]],
             t0: float) -> Result | list[Result]:
    seconds = time.perf_counter() - t0
    results = []
    for tokens, st in zip(outs, stats, strict=True):
        st["seconds"] = seconds
        if not single:
            st["batch"] = len(outs)
        results.append((torch.tensor(tokens, dtype=torch.long), st))
    return results[0] if single else results


def _cut(new: list[int], stops: frozenset[int]) -> tuple[list[int], bool]:
    """*new* up to and including its first stop token, and whether there was one."""
    for i, token in enumerate(new):
        if token in stops:
            return new[:i + 1], True
    return new, False


def _capacity(seqs: list[list[int]], n: int, k: int = 0) -> int:
    # every real position is below len(prompt) + n; padded rows and the drafts past the
    # end of a row write up to one more prompt and k + 1 more (Note [Ragged rows])
    longest = max(len(s) for s in seqs)
    return 2 * longest + n + 2 * k + 4


# --------------------------------------------------------------------------------------
# greedy
# --------------------------------------------------------------------------------------


def _last_states(x: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Each row's state at its last real input: ``[B, d]``."""
    if len(widths) == 1:
        return x[:, widths[0] - 1]
    return x[torch.arange(len(widths)), torch.tensor(widths) - 1]


def greedy(target: Any, ids: Prompts, n: int, *, stop: Iterable[int] | int | None = None,
           ) -> Result | list[Result]:
    """Plain greedy decoding of the target, one pass per token, with a KV cache.

    *ids*: one prompt (``[1, prompt_len]``) or a list of prompts of any lengths, run as
    one batch (one result per prompt, each equal to running it alone). *stop*: token ids
    that end a sequence (the stop token is the last one returned); by default the
    model's end-of-sequence ids, as transformers' ``generate`` (``stop=()``: none).

    >>> tokens, stats = greedy(target, encode("import "), 16)
    """
    seqs, single = _check_prompts(ids, n)
    stops = _check_stop(stop, target)
    t0 = time.perf_counter()
    with torch.inference_mode():
        run = Runner(target)
        run.check_length(max(len(s) for s in seqs) + n - 1)
        rows = len(seqs)
        cache = run.new_cache(_capacity(seqs, n), batch=rows)
        stats = [_stats() for _ in seqs]
        outs: list[list[int]] = [[] for _ in seqs]
        lengths = [0] * rows
        done = [False] * rows
        chunks: list[list[int]] = [list(s) for s in seqs]
        while True:
            x, widths = run.embed_rows(chunks)
            x = run.run_rows(x, lengths, cache)
            best = run.logits(_last_states(x, widths)).argmax(-1).tolist()
            for r in range(rows):
                if done[r]:
                    continue  # fed a placeholder at its end: never read (Note [Ragged rows])
                lengths[r] += widths[r]
                outs[r].append(best[r])
                stats[r]["target_passes"] += 1
                stats[r]["tokens_per_pass"].append(1)
                done[r] = len(outs[r]) == n or best[r] in stops
                chunks[r] = [best[r]]
            if all(done):
                break
    return _results(single, outs, stats, t0)


# --------------------------------------------------------------------------------------
# speculative decoding
# --------------------------------------------------------------------------------------


def accept_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The speculative-sampling acceptance rule: ``min(1, p(t) / q(t))`` for a draft token
    ``t`` with target probability ``p`` and draft probability ``q``. Edit it to try
    another rule; the test of the output distribution rejects a wrong one."""
    return torch.clamp(p / q, max=1.0)


class _Drafts:
    """What a round's drafting produced, per row: the tokens and, when sampling, the draft
    distribution each was drawn from (``None`` for a deterministic proposal)."""

    def __init__(self, rows: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.q: list[list[torch.Tensor | None]] = [[] for _ in range(rows)]


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
            confidence: bool) -> tuple[int, torch.Tensor | None, float]:
    """A draft token from *logits*: the argmax (greedy) or a sample; its distribution when
    sampling; and, with *confidence*, its probability under the draft (what an adaptive
    draft length reads; 1.0 without)."""
    if temperature > 0:
        q = torch.softmax(logits.float() / temperature, dim=-1)
        token = int(torch.multinomial(q, 1, generator=generator))
        return token, q, float(q[token])
    token = int(logits.argmax())
    if not confidence:
        return token, None, 1.0
    return token, None, float(torch.exp(logits[token] - torch.logsumexp(logits.float(), 0)))


class _ModelDrafter:
    """A draft model with its own KV cache (one length per row).

    Note [Cache invariant]
    Both caches hold a prefix of ``seq + drafts``: everything but the tokens in
    ``(seq + drafts)[length:]``, which the next forward of that model feeds first. After
    the verification, only ``seq`` (now including the accepted drafts and the correction
    or bonus token) is valid: each cache is cropped to the part of it that is still a
    prefix of ``seq`` minus its last token, which nobody has fed yet. The target fed every
    draft, so it keeps ``len(seq) - 1``; the draft never fed its own last proposal, so
    after a full acceptance it lags two tokens behind and catches up in one two-token
    forward at the start of the next round.
    """

    def __init__(self, run: Runner, seqs: list[list[int]], n: int, k: int,
                 temperature: float, generator: torch.Generator | None,
                 confidence: float | None, hi: int | None = None) -> None:
        self.run, self.temperature, self.generator = run, temperature, generator
        self.confidence, self.hi = confidence, hi
        self.cache = run.new_cache(_capacity(seqs, n, k), batch=len(seqs))
        self.lengths = [0] * len(seqs)
        # a single row's steps through the whole draft: Runner.draft_step
        self.stepwise = hi is None

    def _states(self, chunks: list[list[int]], rows: list[int]) -> tuple[torch.Tensor, list[int]]:
        x, widths = self.run.embed_rows(chunks)
        return self.run.run_rows(x, self.lengths, self.cache, 0, self.hi), widths

    def _logits(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        return self.run.logits(_last_states(x, widths))

    def propose(self, seqs: list[list[int]], budgets: dict[int, int]) -> _Drafts:
        drafts = _Drafts(len(seqs))
        if self.stepwise and len(seqs) == 1 and self.temperature <= 0 \
                and self.confidence is None:
            return self._greedy_row(seqs[0], budgets.get(0, 0), drafts)
        going = [r for r, b in budgets.items() if b > 0]
        while going:
            chunks = [(seqs[r] + drafts.tokens[r])[self.lengths[r]:] if r in going else [0]
                      for r in range(len(seqs))]
            if self.stepwise and len(chunks) == 1:  # sampling or confidence: true logits
                logits = self.run.draft_step(chunks[0], self.lengths[0], self.cache)
                widths = [len(chunks[0])]
            else:
                x, widths = self._states(chunks, going)
                logits = self._logits(x, widths)
            still = []
            for r in going:
                self.lengths[r] += widths[r]
                token, q, prob = _choose(logits[r], self.temperature, self.generator,
                                         self.confidence is not None)
                drafts.tokens[r].append(token)
                drafts.q[r].append(q)
                if len(drafts.tokens[r]) < budgets[r] and (
                        self.confidence is None or prob >= self.confidence):
                    still.append(r)
            going = still
        return drafts

    def _greedy_row(self, seq: list[int], budget: int, drafts: _Drafts) -> _Drafts:
        """What :meth:`propose` drafts for one row at temperature 0 and a fixed length: the
        same steps without the bookkeeping of rows, distributions and confidence."""
        tokens = drafts.tokens[0]
        feed = seq[self.lengths[0]:]
        while len(tokens) < budget:
            logits = self.run.draft_step(feed, self.lengths[0], self.cache, ranking=True)
            self.lengths[0] += len(feed)
            feed = [int(logits.argmax())]
            tokens.append(feed[0])
        drafts.q[0] = [None] * len(tokens)
        return drafts

    def crop(self, seqs: list[list[int]], rows: list[int]) -> None:
        for r in rows:
            self.lengths[r] = min(self.lengths[r], len(seqs[r]) - 1)


class _Verifier:
    """The full target with its own KV cache (one length per row)."""

    def __init__(self, run: Runner, seqs: list[list[int]], n: int, k: int) -> None:
        self.run = run
        self.cache = run.new_cache(_capacity(seqs, n, k), batch=len(seqs))
        self.lengths = [0] * len(seqs)

    def score(self, seqs: list[list[int]], drafts: _Drafts, rows: list[int],
              ) -> dict[int, torch.Tensor]:
        """Logits ``[len(drafts) + 1, vocab]`` of each row in *rows*: at its last token
        and at each of its drafts."""
        chunks = [(seqs[r] + drafts.tokens[r])[self.lengths[r]:] if r in rows else [0]
                  for r in range(len(seqs))]
        x, widths = self.run.embed_rows(chunks)
        x = self.run.run_rows(x, self.lengths, self.cache)
        out = {}
        for r in rows:
            self.lengths[r] += widths[r]
            m = len(drafts.tokens[r]) + 1
            out[r] = self.run.logits(x[r, widths[r] - m:widths[r]])
        return out

    def crop(self, seqs: list[list[int]], rows: list[int]) -> None:
        for r in rows:
            self.lengths[r] = len(seqs[r]) - 1


class _SharedSelf(_ModelDrafter):
    """Self-speculative decoding on one KV cache: the draft is the target's first
    *exit_layer* layers, and the verification runs only the layers after them.

    Note [Shared early layers]
    The first E layers' keys, values and output for a token depend only on the tokens
    before it, so the draft's pass over a token is also the first E layers of the
    target's pass over it (LayerSkip's reuse). The draft writes layers 0..E-1 of the one
    cache and keeps its layer-E states (``pending``) for the positions the later layers
    have not seen; the verification feeds the one token the draft never fed (its last
    proposal) through layers 0..E-1, then all pending states through layers E..L-1. Two
    lengths per row: ``lengths`` (layers 0..E-1, as the draft's) and ``late`` (layers
    E..L-1, as the target's); ``pending[r]`` covers the positions ``late..lengths``. Both
    are cropped as in Note [Cache invariant], after which ``pending`` is empty.
    """

    def __init__(self, run: Runner, exit_layer: int, seqs: list[list[int]], n: int, k: int,
                 temperature: float, generator: torch.Generator | None,
                 confidence: float | None) -> None:
        super().__init__(run, seqs, n, k, temperature, generator, confidence, hi=exit_layer)
        self.stepwise = False  # its steps keep their states (pending)
        self.exit_layer = exit_layer
        self.late = [0] * len(seqs)
        self.pending: list[list[torch.Tensor]] = [[] for _ in seqs]

    def _states(self, chunks: list[list[int]], rows: list[int]) -> tuple[torch.Tensor, list[int]]:
        x, widths = super()._states(chunks, rows)
        for r in rows:
            self.pending[r].append(x[r, :widths[r]])
        return x, widths

    def score(self, seqs: list[list[int]], drafts: _Drafts, rows: list[int],
              ) -> dict[int, torch.Tensor]:
        rest = [(seqs[r] + drafts.tokens[r])[self.lengths[r]:] if r in rows else []
                for r in range(len(seqs))]
        feed = [r for r in rows if rest[r]]
        if feed:
            self._states([c if c else [0] for c in rest], feed)
            for r in feed:
                self.lengths[r] += len(rest[r])
        states = [torch.cat(self.pending[r]) if r in rows else
                  torch.zeros(1, self.run.dim, dtype=self.run.dtype) for r in range(len(seqs))]
        widths = [s.shape[0] for s in states]
        t = max(widths)
        x = torch.stack([torch.cat([s, s[-1:].expand(t - s.shape[0], -1)]) for s in states])
        x = self.run.run_rows(x, self.late, self.cache, self.exit_layer)
        out = {}
        for r in rows:
            self.late[r] += widths[r]
            self.pending[r] = []
            m = len(drafts.tokens[r]) + 1
            out[r] = self.run.logits(x[r, widths[r] - m:widths[r]])
        return out

    def crop(self, seqs: list[list[int]], rows: list[int]) -> None:
        super().crop(seqs, rows)
        for r in rows:
            self.late[r] = len(seqs[r]) - 1


class _Lookup:
    """Prompt-lookup drafts: the tokens that followed the last earlier occurrence of the
    sequence's final n-gram (the longest of ``max_ngram..1`` that occurred before)."""

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram

    def _find(self, seq: list[int], budget: int) -> list[int]:
        for size in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            tail = seq[-size:]
            for start in range(len(seq) - size - 1, -1, -1):
                if seq[start:start + size] == tail:
                    return seq[start + size:start + size + budget]
        return []

    def propose(self, seqs: list[list[int]], budgets: dict[int, int]) -> _Drafts:
        drafts = _Drafts(len(seqs))
        for r, budget in budgets.items():
            if budget > 0:
                drafts.tokens[r] = self._find(seqs[r], budget)
                drafts.q[r] = [None] * len(drafts.tokens[r])
        return drafts

    def crop(self, seqs: list[list[int]], rows: list[int]) -> None:
        pass


def _verify(logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor | None],
            temperature: float, generator: torch.Generator | None) -> tuple[list[int], int]:
    """The tokens a round commits, from the target's *logits* at the last token and at
    each draft, and how many drafts were accepted."""
    new: list[int] = []
    if temperature <= 0:
        best = logits.argmax(dim=-1).tolist()
        for i, token in enumerate(drafts):
            if best[i] != token:
                break
            new.append(token)
        accepted = len(new)
        return new + [best[accepted]], accepted
    ps = torch.softmax(logits.float() / temperature, dim=-1)
    for i, token in enumerate(drafts):
        q = qs[i]
        # a deterministic proposal (prompt lookup) is a draft distribution with all its
        # mass on the token: q(t) = 1, and the residual is p without t
        q_token = torch.ones(()) if q is None else q[token]
        u = torch.rand((), generator=generator)
        if bool(u < accept_probability(ps[i, token], q_token)):
            new.append(token)
            continue
        if q is None:
            residual = ps[i].clone()
            residual[token] = 0.0
        else:
            residual = torch.clamp(ps[i] - q, min=0.0)
        total = residual.sum()
        dist = residual / total if float(total) > 0 else ps[i]
        new.append(int(torch.multinomial(dist, 1, generator=generator)))
        return new, i
    new.append(int(torch.multinomial(ps[len(drafts)], 1, generator=generator)))
    return new, len(drafts)


def _speculate(drafter: Any, verifier: Any, seqs: list[list[int]], n: int, k: int,
               temperature: float, generator: torch.Generator | None,
               stats: list[dict[str, Any]], stops: frozenset[int]) -> list[list[int]]:
    """Rounds of draft-then-verify over every row until each has *n* new tokens or a stop
    token; returns each row's new tokens."""
    outs: list[list[int]] = [[] for _ in seqs]
    done = [False] * len(seqs)
    while not all(done):
        rows = [r for r in range(len(seqs)) if not done[r]]
        # the round commits at most k + 1 tokens, and no row more than it still needs
        budgets = {r: min(k, n - len(outs[r]) - 1) for r in rows}
        drafts = drafter.propose(seqs, budgets)
        scored = verifier.score(seqs, drafts, rows)
        for r in rows:
            new, accepted = _verify(scored[r], drafts.tokens[r], drafts.q[r], temperature,
                                    generator)
            new, stopped = _cut(new, stops)
            seqs[r].extend(new)
            outs[r].extend(new)
            done[r] = stopped or len(outs[r]) >= n
            proposed = len(drafts.tokens[r])
            stats[r]["target_passes"] += 1
            stats[r]["accepted"].append(accepted)
            stats[r]["proposed"].append(proposed)
            stats[r]["acceptance"].append(accepted / proposed if proposed else None)
            stats[r]["tokens_per_pass"].append(len(new))
        verifier.crop(seqs, rows)
        drafter.crop(seqs, rows)
    return outs


def _check_pair(target: Any, draft: Any) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"the draft's vocabulary ({dv} tokens) differs from the target's "
                         f"({tv} tokens): speculative decoding needs the same tokenizer")


def speculative(target: Any, draft: Any, ids: Prompts, n: int, k: int,
                temperature: float = 0.0, *, generator: torch.Generator | None = None,
                confidence: float | None = None, stop: Iterable[int] | int | None = None,
                ) -> Result | list[Result]:
    """Speculative decoding: *draft* proposes up to *k* tokens, *target* verifies them in
    one pass.

    ``temperature=0``: greedy verification (output identical to :func:`greedy`).
    ``temperature>0``: speculative sampling from ``softmax(logits / temperature)`` of the
    target, exactly (randomness from *generator*).
    *confidence*: an adaptive draft length: the draft stops early after a token whose
    probability under the draft is below it (transformers' ``assistant_confidence_
    threshold``); *k* is then the most it drafts. Exact either way: when to stop drafting
    depends only on the draft. *ids* may be a list of prompts (run as one batch; at
    ``temperature>0`` the rows share *generator*, so a row's samples differ from running
    it alone, with the same distribution), *stop* token ids end a sequence early.

    ``stats``: ``accepted``/``proposed`` (draft tokens per round), ``acceptance`` (their
    ratio), ``tokens_per_pass`` (tokens committed per target pass), ``target_passes``,
    ``exit_layers`` (empty here), ``seconds``.

    >>> tokens, stats = speculative(target, draft, encode("def "), 64, k=4)
    """
    seqs, single = _check_prompts(ids, n)
    _check_k(k)
    _check_pair(target, draft)
    _check_temperature(temperature)
    _check_confidence(confidence)
    stops = _check_stop(stop, target)
    t0 = time.perf_counter()
    stats = [_stats(k=k) for _ in seqs]
    with torch.inference_mode():
        run, draft_run = Runner(target), Runner(draft)
        longest = max(len(s) for s in seqs) + n - 1
        run.check_length(longest)
        draft_run.check_length(longest)
        outs = _speculate(_ModelDrafter(draft_run, seqs, n, k, temperature, generator,
                                        confidence),
                          _Verifier(run, seqs, n, k), seqs, n, k, temperature, generator,
                          stats, stops)
    return _results(single, outs, stats, t0)


def self_speculative(target: Any, ids: Prompts, n: int, k: int, exit_layer: int,
                     temperature: float = 0.0, *, generator: torch.Generator | None = None,
                     confidence: float | None = None, stop: Iterable[int] | int | None = None,
                     ) -> Result | list[Result]:
    """Self-speculative decoding: the target's first *exit_layer* layers (with the shared
    head after the final norm) draft up to *k* tokens, the rest of the target verifies,
    reusing the draft's keys, values and states of those layers (one KV cache: Note
    [Shared early layers]). Exact like :func:`speculative` (greedy at ``temperature=0``,
    the target's distribution at ``temperature>0``); *confidence*, *stop* and lists of
    prompts as there.

    >>> tokens, stats = self_speculative(target, encode("class "), 64, k=4, exit_layer=2)
    """
    seqs, single = _check_prompts(ids, n)
    _check_k(k)
    _check_temperature(temperature)
    _check_confidence(confidence)
    stops = _check_stop(stop, target)
    layers = int(target.config.num_hidden_layers)
    if not isinstance(exit_layer, int) or not 1 <= exit_layer < layers:
        raise ValueError(f"exit_layer must be an integer in 1..{layers - 1} (the target has "
                         f"{layers} layers), got {exit_layer!r}")
    t0 = time.perf_counter()
    stats = [_stats(k=k, exit_layers=[exit_layer]) for _ in seqs]
    with torch.inference_mode():
        run = Runner(target)
        run.check_length(max(len(s) for s in seqs) + n - 1)
        shared = _SharedSelf(run, exit_layer, seqs, n, k, temperature, generator, confidence)
        outs = _speculate(shared, shared, seqs, n, k, temperature, generator, stats, stops)
    return _results(single, outs, stats, t0)


def prompt_lookup(target: Any, ids: Prompts, n: int, k: int = 10, max_ngram: int = 3,
                  temperature: float = 0.0, *, generator: torch.Generator | None = None,
                  stop: Iterable[int] | int | None = None) -> Result | list[Result]:
    """Prompt-lookup decoding: no draft model; the drafts are the up to *k* tokens that
    followed the last earlier occurrence of the sequence's final n-gram (the longest,
    up to *max_ngram*, that occurred before), verified by the target in one pass. Exact
    like :func:`speculative` (a lookup is a draft that puts all its mass on one token);
    *stop* and lists of prompts as there.

    >>> tokens, stats = prompt_lookup(target, encode("self.x = x\\n    self."), 64)
    """
    seqs, single = _check_prompts(ids, n)
    _check_k(k)
    _check_temperature(temperature)
    if not isinstance(max_ngram, int) or max_ngram < 1:
        raise ValueError(f"max_ngram must be an integer >= 1, got {max_ngram!r}")
    stops = _check_stop(stop, target)
    t0 = time.perf_counter()
    stats = [_stats(k=k) for _ in seqs]
    with torch.inference_mode():
        run = Runner(target)
        run.check_length(max(len(s) for s in seqs) + n - 1)
        outs = _speculate(_Lookup(max_ngram), _Verifier(run, seqs, n, k), seqs, n, k,
                          temperature, generator, stats, stops)
    return _results(single, outs, stats, t0)


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


def _confident(logits: torch.Tensor, threshold: float) -> bool:
    return float(torch.exp(logits.max() - torch.logsumexp(logits, 0))) >= threshold


def early_exit(target: Any, ids: Prompts, n: int, thresholds: float | Sequence[float], *,
               stop: Iterable[int] | int | None = None) -> Result | list[Result]:
    """Greedy decoding that stops each token at the first layer whose max probability (the
    shared head after the final norm) reaches that layer's threshold.

    ``thresholds``: one per exit after layers ``1..L-1`` (or one float for all). The
    layers a token skipped still get its keys and values, computed from the exited state
    (CALM's state propagation), so later tokens can attend to it. ``stats["exit_layers"]``
    is the number of layers each token ran (``1..L``). *stop* and lists of prompts as in
    :func:`greedy` (in a batch, a layer runs while any row still needs it; the rows that
    left keep their exited state, from which the layer computes their keys and values).

    >>> tokens, stats = early_exit(target, encode("for "), 64, 0.9)
    """
    seqs, single = _check_prompts(ids, n)
    limits = _thresholds(target, thresholds) + [-1.0]  # the last layer always answers
    stops = _check_stop(stop, target)
    t0 = time.perf_counter()
    stats = [_stats() for _ in seqs]
    with torch.inference_mode():
        run = Runner(target)
        run.check_length(max(len(s) for s in seqs) + n - 1)
        rows = len(seqs)
        cache = run.new_cache(_capacity(seqs, n), batch=rows)
        x, widths = run.embed_rows(seqs)  # the prompt runs every layer
        x = run.run_rows(x, [0] * rows, cache)
        outs = [[t] for t in run.logits(_last_states(x, widths)).argmax(-1).tolist()]
        lengths = list(widths)
        done = [len(o) == n or o[-1] in stops for o in outs]
        for st in stats:
            st["exit_layers"].append(run.depth)
            st["target_passes"] += 1
        while not all(done):
            x = run.embed[torch.tensor([0 if d else o[-1] for o, d in zip(outs, done,
                                                                        strict=True)])]
            x = x.unsqueeze(1)  # [B, 1, d]
            start: int | torch.Tensor = lengths[0] if rows == 1 else torch.tensor(lengths)
            frozen = list(done)  # rows whose state no longer changes: the rest of the
            chosen: dict[int, tuple[int, int]] = {}  # layers get their keys from it
            for i in range(run.depth):
                if all(frozen):
                    run.fill_kv(i, x, start, cache)
                    continue
                y = run.layer(i, x, start, cache)
                moving = [r for r in range(rows) if not frozen[r]]
                logits = run.logits(y[moving, 0])
                for j, r in enumerate(moving):
                    if _confident(logits[j], limits[i]):
                        frozen[r] = True
                        chosen[r] = (int(logits[j].argmax()), i + 1)
                if len(moving) == rows:
                    x = y
                else:
                    mask = torch.zeros(rows, 1, 1, dtype=torch.bool)
                    mask[moving] = True
                    x = torch.where(mask, y, x)
            for r, (token, layer) in chosen.items():
                lengths[r] += 1
                outs[r].append(token)
                stats[r]["exit_layers"].append(layer)
                stats[r]["target_passes"] += 1
                done[r] = len(outs[r]) == n or token in stops
    for o, st in zip(outs, stats, strict=True):
        st["tokens_per_pass"] = [1] * len(o)
    return _results(single, outs, stats, t0)


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
            tokens, _ = cast(Result, early_exit(target, ids, n, t))
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


def _loss(model: Any, batch: torch.Tensor, exit_loss: bool, teacher: Any = None,
          ) -> tuple[torch.Tensor, list[float]]:
    """Next-byte cross-entropy of the last layer, plus, with *exit_loss*, :data:`EXIT_WEIGHT`
    times the mean over the intermediate exits (shared head after the final norm) of
    theirs. Returns the loss and every exit's cross-entropy. With a *teacher*, the loss is
    instead KL(teacher || model) of the next-byte distributions (Note [A distilled draft])."""
    run = Runner(model)
    inputs, labels = batch[:, :-1], batch[:, 1:].reshape(-1)
    states = run.hidden_states(inputs)
    if teacher is not None:
        with torch.no_grad():
            taught = Runner(teacher)
            wanted = F.log_softmax(taught.logits(taught.hidden_states(inputs)[-1]), -1)
        kl = F.kl_div(F.log_softmax(run.logits(states[-1]), -1).reshape(-1, run.vocab),
                      wanted.reshape(-1, run.vocab), log_target=True, reduction="batchmean")
        return kl, [float(kl.detach())]
    chosen = states if exit_loss else states[-1:]
    losses = [F.cross_entropy(run.logits(h).reshape(-1, run.vocab), labels) for h in chosen]
    total = losses[-1] + (EXIT_WEIGHT * torch.stack(losses[:-1]).mean() if len(losses) > 1 else 0)
    return total, [float(x.detach()) for x in losses]


def train(model: Any, spec: TrainSpec, data: torch.Tensor, seed: int = SEED,
          log_every: int = 50, teacher: Any = None) -> dict[str, Any]:
    """AdamW with warm-up and cosine decay on random windows of *data*; returns the
    losses (last-layer loss averaged over the last 50 steps, and per exit). With
    ``spec.distill``, *teacher* (a trained model of the same vocabulary) gives the
    targets and the losses are its KL to the model's (Note [A distilled draft])."""
    if spec.distill and teacher is None:
        raise ValueError("a distilled recipe needs the teacher model")
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
        return _train_steps(model, spec, data, gen, opt, lr_at, log_every,
                            teacher if spec.distill else None)
    finally:
        torch.set_num_threads(threads)
        model.eval()


def _train_steps(model: Any, spec: TrainSpec, data: torch.Tensor, gen: torch.Generator,
                 opt: torch.optim.Optimizer, lr_at: Callable[[int], float],
                 log_every: int, teacher: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    recent: list[list[float]] = []
    batches = _batches(data, spec, gen)
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss, parts = _loss(model, next(batches), spec.exit_loss, teacher)
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
            "exit_losses": per_exit, "steps": spec.steps, "distilled": teacher is not None}


def _eval_loss(model: Any, data: torch.Tensor, exit_loss: bool) -> list[float]:
    gen = torch.Generator().manual_seed(SEED + 7)
    spec = TrainSpec(steps=0, batch=32, seq_len=128, lr=0, exit_loss=exit_loss)
    with torch.inference_mode():
        return _loss(model, next(_batches(data, spec, gen)), exit_loss)[1]


def _spec(name: str, config: dict[str, Any], recipe: TrainSpec) -> dict[str, Any]:
    # The library versions are recorded beside the spec, not in it (Note [Version bumps]).
    # ``distill`` is named only where set: a target built before the field existed is
    # still the same recipe.
    train = {k: v for k, v in recipe.__dict__.items() if k != "distill" or v}
    return {"name": name, "version": BUILD_VERSION, "config": config, "train": train,
            "exit_weight": EXIT_WEIGHT if recipe.exit_loss else None,
            "seed": SEED, "python": sys.version.split()[0]}


def _versions() -> dict[str, Any]:
    return {"transformers": _version("transformers"), "torch": torch.__version__}


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


def _still_loads(path: Path) -> bool:
    """Whether the model saved at *path* loads with the libraries installed now."""
    # Note [Version bumps]
    # A model trained under other torch/transformers versions is the same model as long as
    # the installed ones read it: its weights do not depend on the versions that wrote
    # them (retraining would give the same recipe, not the same bytes anyway). So a
    # version bump costs one load here (a test directory without weights has nothing to
    # load and counts as loading), not a ten-minute retrain.
    if not any(path.glob("*.safetensors")):
        return True
    try:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any failure to load means: rebuild
        _log(f"{path.name} was built with other library versions and does not load "
             f"({type(exc).__name__}: {exc}); rebuilding it")
        return False
    return True


def _build_one(path: Path, spec: dict[str, Any], write: Callable[[Path], dict[str, Any]],
               ) -> Path:
    # Note [Atomic build]
    # A directory counts as built only when its marker (written last) records the same
    # spec. The model is trained and saved into a private ``.<name>.partial`` sibling and
    # renamed into place, under a lock, so a crash or ^C never leaves a directory that
    # looks finished, and two processes never train the same model at once.
    def done() -> bool:
        marker = read_marker(path)
        if marker is None or marker.get("spec") != spec:
            return False
        return marker.get("versions") == _versions() or _still_loads(path)

    if done():
        return path
    with _locked(path):
        if done():
            return path
        partial = path.parent / f".{path.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        record = write(partial)
        (partial / MARKER).write_text(json.dumps({"spec": spec, "versions": _versions(),
                                                  **record}, indent=1))
        if path.exists():
            if read_marker(path) is None and any(path.iterdir()):
                raise FileExistsError(f"{path} exists and was not built by decoding.build(); "
                                      "remove it or choose another models directory")
            shutil.rmtree(path)
        os.rename(partial, path)
    return path


def _writer(config: dict[str, Any], recipe: TrainSpec, seed: int, teacher: Path | None = None,
            ) -> Callable[[Path], dict[str, Any]]:
    def write(out: Path) -> dict[str, Any]:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**config))
        params = sum(p.numel() for p in model.parameters())
        _log(f"training {out.name.strip('.').removesuffix('.partial')}: {params / 1e6:.2f}M "
             f"parameters, {recipe.steps} steps of {recipe.batch}x{recipe.seq_len} bytes")
        data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
        taught = None
        if recipe.distill:
            assert teacher is not None
            taught = LlamaForCausalLM.from_pretrained(teacher).eval()
            taught.requires_grad_(False)
        record = train(model, recipe, data, seed, teacher=taught)
        held = torch.frombuffer(bytearray(corpus(held_out=True)), dtype=torch.uint8)
        record["held_out_losses"] = _eval_loss(model, held, recipe.exit_loss)
        record["parameters"] = params
        model.save_pretrained(out)
        what = "KL from the target" if recipe.distill else "loss"
        _log(f"trained in {record['seconds']:.0f} s: {what} {record['final_loss']:.3f} "
             f"(held out {record['held_out_losses'][-1]:.3f} nats/byte)")
        return record

    return write


def build(models_dir: str | os.PathLike[str], steps: int | None = None) -> tuple[Path, Path]:
    """Train (once) and save the target and the draft under *models_dir*; returns
    ``(target_dir, draft_dir)``. Later calls find the finished directories and return at
    once. Training takes about 10 minutes on two cores.

    *steps*: a smaller recipe for quick runs (the target trains *steps* steps, the draft
    proportionally fewer), kept in its own directories (``decoding-target-<steps>steps``)
    beside the full ones: ``build(dir, steps=40)`` takes well under a minute and gives
    models that are still far better than uniform bytes, not good ones.
    """
    root = Path(models_dir).expanduser().absolute()
    target_recipe, draft_recipe, suffix = TARGET_TRAIN, DRAFT_TRAIN, ""
    if steps is not None:
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        target_recipe = replace(TARGET_TRAIN, steps=steps)
        draft_recipe = replace(DRAFT_TRAIN, steps=max(
            1, round(steps * DRAFT_TRAIN.steps / TARGET_TRAIN.steps)))
        suffix = f"-{steps}steps"
    target_spec = _spec("target", TARGET_CONFIG, target_recipe)
    target = _build_one(root / f"decoding-target{suffix}", target_spec,
                        _writer(TARGET_CONFIG, target_recipe, SEED))
    # a draft distilled from another target is another draft
    draft = _build_one(root / f"decoding-draft{suffix}",
                       {**_spec("draft", DRAFT_CONFIG, draft_recipe), "teacher": target_spec},
                       _writer(DRAFT_CONFIG, draft_recipe, SEED + 1, teacher=target))
    return target, draft
