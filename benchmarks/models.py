"""Random-weight Stable Diffusion 1.5 components, built locally.

Nothing here downloads anything: every component is created from its real
Stable Diffusion 1.5 configuration (written below as Python dicts), filled with
random weights and saved with the library's own ``save_pretrained`` (safetensors),
so the directories load through the ordinary ``from_pretrained`` of diffusers and
transformers exactly like the published checkpoints (same classes, same tensor
names, shapes and counts: 686 tensors / 859.5M parameters for the UNet).

``tiny=True`` gives the same classes with very small channels and layers (a few MB),
for fast tests.

Building is idempotent. A finished directory holds a completion marker
(``.overmind-built.json``: component, configuration hash, file sizes); a later call
that finds a valid marker returns at once without touching the files. A build writes
into a private sibling directory (``.<name>.partial``) and renames it into place at
the end, under a lock, so an interrupted build never leaves a directory that looks
finished and is simply redone by the next call.

Weights are created fast: the module is instantiated on the ``meta`` device (no
memory, no initialisation), moved to the target dtype, materialised with
``to_empty`` and every tensor filled in place with ``uniform_`` from one seeded
``torch.Generator`` (deterministic for a given seed), directly in the target dtype.
This takes a few seconds for the 860M-parameter UNet where the modules' own
initialisers take minutes on two cores.

Progress (component, parameters, bytes written) goes to stderr.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overmind_lab._common.sizes import format_size

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "CONTROLNET_CONFIG",
    "CONTROLNET_CONFIG_TINY",
    "DDIM_SCHEDULER_CONFIG",
    "MARKER",
    "PNDM_SCHEDULER_CONFIG",
    "TEXT_ENCODER_CONFIG",
    "TEXT_ENCODER_CONFIG_TINY",
    "TOKENIZER_CONFIG",
    "UNET_CONFIG",
    "UNET_CONFIG_TINY",
    "VAE_CONFIG",
    "VAE_CONFIG_TINY",
    "build_controlnet",
    "build_scheduler",
    "build_sd15_pipeline",
    "build_text_encoder",
    "build_tokenizer",
    "build_unet",
    "build_vae",
    "is_built",
    "read_marker",
]

#: Name of the completion marker written last into every finished directory.
MARKER = ".overmind-built.json"
#: Bumped when the way weights or files are produced changes (invalidates old builds).
_FORMAT_VERSION = 1
_DEFAULT_SEED = 0

PathLike = str | os.PathLike[str]

# --------------------------------------------------------------------------------------
# Stable Diffusion 1.5 configurations (runwayml/stable-diffusion-v1-5, lllyasviel ControlNet)
# --------------------------------------------------------------------------------------

#: ``unet/config.json`` of Stable Diffusion 1.5.
UNET_CONFIG: dict[str, Any] = {
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": [
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": [
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    ],
}

#: Same class and block layout as :data:`UNET_CONFIG`, tiny channels (about 1M parameters).
UNET_CONFIG_TINY: dict[str, Any] = {
    **UNET_CONFIG,
    "block_out_channels": [32, 32, 64, 64],
    "layers_per_block": 1,
    "cross_attention_dim": 32,
    "attention_head_dim": 4,
    "sample_size": 16,
}

#: ``vae/config.json`` of Stable Diffusion 1.5.
VAE_CONFIG: dict[str, Any] = {
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}

#: Same class as :data:`VAE_CONFIG`, tiny channels.
VAE_CONFIG_TINY: dict[str, Any] = {
    **VAE_CONFIG,
    "block_out_channels": [32, 64],
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "layers_per_block": 1,
    "sample_size": 32,
}

#: ``text_encoder/config.json`` of Stable Diffusion 1.5 (OpenAI CLIP ViT-L/14 text tower).
TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "projection_dim": 768,
    "vocab_size": 49408,
}

#: Same class as :data:`TEXT_ENCODER_CONFIG`, tiny width and depth (same vocabulary,
#: so it works with the tokenizer of :func:`build_tokenizer`).
TEXT_ENCODER_CONFIG_TINY: dict[str, Any] = {
    **TEXT_ENCODER_CONFIG,
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "projection_dim": 32,
}

#: ``scheduler/scheduler_config.json`` of Stable Diffusion 1.5 (PNDM).
PNDM_SCHEDULER_CONFIG: dict[str, Any] = {
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}

#: The DDIM scheduler configuration commonly used with Stable Diffusion 1.5.
DDIM_SCHEDULER_CONFIG: dict[str, Any] = {
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "trained_betas": None,
}

#: ``tokenizer/tokenizer_config.json`` fields of Stable Diffusion 1.5.
TOKENIZER_CONFIG: dict[str, Any] = {
    "model_max_length": 77,
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
    "do_lower_case": True,
    "errors": "replace",
}
_TOKENIZER_VOCAB_SIZE = 49408

#: ``config.json`` of the Stable Diffusion 1.5 ControlNets (lllyasviel/sd-controlnet-*).
CONTROLNET_CONFIG: dict[str, Any] = {
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "class_embed_type": None,
    "conditioning_embedding_out_channels": [16, 32, 96, 256],
    "controlnet_conditioning_channel_order": "rgb",
    "cross_attention_dim": 768,
    "down_block_types": [
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "projection_class_embeddings_input_dim": None,
    "resnet_time_scale_shift": "default",
    "upcast_attention": False,
    "use_linear_projection": False,
}

#: Same class as :data:`CONTROLNET_CONFIG`, matching :data:`UNET_CONFIG_TINY`.
CONTROLNET_CONFIG_TINY: dict[str, Any] = {
    **CONTROLNET_CONFIG,
    "block_out_channels": UNET_CONFIG_TINY["block_out_channels"],
    "layers_per_block": UNET_CONFIG_TINY["layers_per_block"],
    "cross_attention_dim": UNET_CONFIG_TINY["cross_attention_dim"],
    "attention_head_dim": UNET_CONFIG_TINY["attention_head_dim"],
    "conditioning_embedding_out_channels": [16, 32],
}

# --------------------------------------------------------------------------------------
# progress, markers, locking
# --------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[overmind-lab models] {msg}", file=sys.stderr, flush=True)


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


@contextlib.contextmanager
def _bytes_ticker(label: str, path: Path, interval: float = 2.0) -> Iterator[None]:
    """Report the bytes written under *path* while the body runs (on change, else every 10 s)."""
    stop = threading.Event()
    t0 = time.perf_counter()

    def tick() -> None:
        last_bytes, last_print = -1, t0
        while not stop.wait(interval):
            now, written = time.perf_counter(), _dir_bytes(path)
            if written != last_bytes or now - last_print >= 10:
                state = "written" if written != last_bytes else "written, flushing"
                _log(f"{label}: {format_size(written)} {state} ({now - t0:.0f} s)")
                last_bytes, last_print = written, now

    thread = threading.Thread(target=tick, name="overmind-models-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _config_hash(spec: dict[str, Any]) -> str:
    blob = json.dumps({"format": _FORMAT_VERSION, **spec}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _list_files(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            full = Path(root, f)
            rel = full.relative_to(path).as_posix()
            if rel == MARKER:
                continue
            out[rel] = full.stat().st_size
    return dict(sorted(out.items()))


def read_marker(path: PathLike) -> dict[str, Any] | None:
    """The completion marker of a built directory, or ``None`` when absent or unreadable."""
    try:
        with open(Path(path) / MARKER, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_valid(path: Path, config_hash: str) -> bool:
    marker = read_marker(path)
    if marker is None or marker.get("config_hash") != config_hash:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for rel, size in files.items():
        try:
            if (path / rel).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def is_built(path: PathLike) -> bool:
    """Whether *path* holds a finished build (valid marker, all files present with their sizes)."""
    marker = read_marker(path)
    return marker is not None and _marker_valid(Path(path), str(marker.get("config_hash")))


def _write_marker(path: Path, spec: dict[str, Any], config_hash: str, seconds: float) -> dict[str, Any]:
    files = _list_files(path)
    marker = {
        "builder": "benchmarks.models",
        "format": _FORMAT_VERSION,
        "config_hash": config_hash,
        **spec,
        "files": files,
        "bytes": sum(files.values()),
        "build_seconds": round(seconds, 3),
        "built_at": time.time(),
    }
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2, sort_keys=True, default=str), encoding="utf-8")
    os.replace(tmp, path / MARKER)
    return marker


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """An exclusive lock for building *target* (a hidden lock file beside it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _looks_like_ours(path: Path) -> bool:
    """A directory we may delete: empty, or carrying our (stale or incomplete) marker."""
    if not path.is_dir():
        return False
    if (path / MARKER).exists() or (path / (MARKER + ".tmp")).exists():
        return True
    return not any(path.iterdir())


def _build_atomic(
    path: PathLike,
    spec: dict[str, Any],
    write: Callable[[Path], None],
) -> Path:
    """Build *path* with *write* unless a valid marker for *spec* is already there.

    *write* fills a fresh private directory; it is renamed into place once the
    marker is written. Returns the absolute path.
    """
    target = Path(path).expanduser().absolute()
    config_hash = _config_hash(spec)
    if _marker_valid(target, config_hash):
        return target
    with _locked(target):
        if _marker_valid(target, config_hash):  # built by someone else meanwhile
            return target
        if target.exists() and not _looks_like_ours(target):
            raise FileExistsError(
                f"{target} exists and was not built by overmind-lab (no {MARKER}); "
                "remove it or choose another path"
            )
        partial = target.parent / f".{target.name}.partial"
        if partial.exists():
            _log(f"removing an interrupted build: {partial}")
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        t0 = time.perf_counter()
        write(partial)
        marker = _write_marker(partial, spec, config_hash, time.perf_counter() - t0)
        if target.exists():
            _log(f"replacing stale build: {target}")
            shutil.rmtree(target)
        os.rename(partial, target)
        _fsync_dir(target.parent)
        _log(
            f"{spec['component']} ready: {target} ({format_size(marker['bytes'])} in "
            f"{time.perf_counter() - t0:.1f} s)"
        )
        return target


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------
# fast random weights
# --------------------------------------------------------------------------------------


def _resolve_dtype(dtype: Any) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(resolved, torch.dtype):
            return resolved
    raise TypeError(f"not a torch dtype: {dtype!r}")


def _init_bounds(name: str, t: torch.Tensor) -> tuple[float, float]:
    """The ``uniform_`` range for one tensor of a state dict."""
    leaf = name.rsplit(".", 1)[-1]
    if t.dim() >= 2:
        if "embedding" in name or "embed" in leaf:
            bound = 0.02 * math.sqrt(3.0)
        else:
            fan_in = t[0].numel()
            bound = math.sqrt(3.0 / max(fan_in, 1))
        return -bound, bound
    if leaf == "weight" or "norm" in name:
        return 0.95, 1.05
    return -0.01, 0.01


def _fill_random_(module: torch.nn.Module, seed: int) -> int:
    """Fill every floating parameter and persistent buffer of a materialised *module*.

    Weight matrices and kernels get ``U(-b, b)`` with ``b = sqrt(3 / fan_in)`` (unit
    variance of the output per input), embeddings ``std 0.02``, normalisation weights
    ``1 +- 0.05``, biases ``+-0.01``. Each tensor has its own generator seeded
    (``torch.Generator.manual_seed``) from (*seed*, its name), so its bytes do not
    depend on the order of the others. Filling runs in the target dtype, directly in
    the tensors' memory (about 100M values/s on one core; more threads do not help:
    first touch of fresh pages dominates). Returns the parameter count.
    """
    import torch

    count = 0
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            t = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            if not t.is_floating_point():
                continue
            digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
            low, high = _init_bounds(name, t)
            t.uniform_(low, high, generator=generator)
            count += t.numel()
    return count


def _materialise(module: torch.nn.Module, dtype: torch.dtype, seed: int) -> int:
    """Move a meta-device *module* to CPU memory in *dtype* and fill it randomly."""
    import torch

    # plain nn.Module.to: diffusers' override warns about fp32 modules, irrelevant here
    torch.nn.Module.to(module, dtype)
    module.to_empty(device="cpu")
    # non-persistent integer buffers (e.g. CLIP's position_ids) are not saved, but keep
    # them sane in case someone uses the built object.
    for name, buf in module.named_buffers():
        if not buf.is_floating_point() and "position_ids" in name:
            buf.copy_(torch.arange(buf.shape[-1]).expand_as(buf))
    return _fill_random_(module, seed)


def _save_module(label: str, module: Any, out: Path) -> None:
    """``save_pretrained`` (safetensors) with a bytes-written ticker on stderr."""
    from transformers import PreTrainedModel

    # transformers 5 always writes safetensors (no ``safe_serialization`` argument)
    kwargs: dict[str, Any] = {} if isinstance(module, PreTrainedModel) else {"safe_serialization": True}
    with _bytes_ticker(f"{label}: saving", out):
        module.save_pretrained(out, **kwargs)


def _meta_device() -> Any:
    import torch

    return torch.device("meta")


# --------------------------------------------------------------------------------------
# component writers (into a given private directory)
# --------------------------------------------------------------------------------------


def _write_diffusers_model(cls_name: str, config: dict[str, Any], dtype: Any, seed: int, label: str) -> Callable[[Path], None]:
    def write(out: Path) -> None:
        import diffusers

        cls = getattr(diffusers, cls_name)
        td = _resolve_dtype(dtype)
        t0 = time.perf_counter()
        with _meta_device():
            model = cls(**copy.deepcopy(config))
        n = _materialise(model, td, seed)
        model.eval()
        _log(f"{label}: {n / 1e6:.1f}M parameters initialised as {_dtype_name(td)} in {time.perf_counter() - t0:.1f} s")
        _save_module(label, model, out)
        del model

    return write


def _write_text_encoder(config: dict[str, Any], dtype: Any, seed: int, label: str) -> Callable[[Path], None]:
    def write(out: Path) -> None:
        from transformers import CLIPTextConfig, CLIPTextModel

        td = _resolve_dtype(dtype)
        t0 = time.perf_counter()
        cfg = CLIPTextConfig(**copy.deepcopy(config))
        cfg.architectures = ["CLIPTextModel"]
        with _meta_device():
            model = CLIPTextModel(cfg)
        n = _materialise(model, td, seed)
        model.eval()  # type: ignore[no-untyped-call]
        with contextlib.suppress(Exception):
            model.config.dtype = td
        _log(f"{label}: {n / 1e6:.1f}M parameters initialised as {_dtype_name(td)} in {time.perf_counter() - t0:.1f} s")
        _save_module(label, model, out)

    return write


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte-level alphabet: every byte mapped to a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _tokenizer_vocab_and_merges(vocab_size: int = _TOKENIZER_VOCAB_SIZE) -> tuple[dict[str, int], list[str]]:
    """A deterministic CLIP-style BPE vocabulary of exactly *vocab_size* tokens.

    Layout as in CLIP: the 256 byte characters, the same with ``</w>``, then one token per
    merge (letter pairs, then letter triples, then longer word endings), and the two
    special tokens last (``<|startoftext|>`` = 49406, ``<|endoftext|>`` = 49407).
    """
    alphabet = list(_bytes_to_unicode().values())
    vocab_list: list[str] = alphabet + [c + "</w>" for c in alphabet]
    n_merges = vocab_size - len(vocab_list) - 2
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    merges: list[str] = []
    seen = set(vocab_list)

    def add(a: str, b: str) -> bool:
        tok = a + b
        if tok in seen:
            return False
        seen.add(tok)
        merges.append(f"{a} {b}")
        vocab_list.append(tok)
        return len(merges) >= n_merges

    level = list(letters)
    done = False
    while not done:
        nxt: list[str] = []
        for prefix in level:
            for c in letters:
                if add(prefix, c):
                    done = True
                    break
                nxt.append(prefix + c)
                if add(prefix, c + "</w>"):
                    done = True
                    break
            if done:
                break
        level = nxt
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab_list) == vocab_size, len(vocab_list)
    return {tok: i for i, tok in enumerate(vocab_list)}, merges


def _write_tokenizer(out: Path) -> None:
    vocab, merges = _tokenizer_vocab_and_merges()
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": True,
        **TOKENIZER_CONFIG,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    special = {
        "bos_token": TOKENIZER_CONFIG["bos_token"],
        "eos_token": TOKENIZER_CONFIG["eos_token"],
        "pad_token": TOKENIZER_CONFIG["pad_token"],
        "unk_token": TOKENIZER_CONFIG["unk_token"],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2), encoding="utf-8")
    _log(f"tokenizer: {len(vocab)} tokens, {len(merges)} merges")


_SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "pndm": ("PNDMScheduler", PNDM_SCHEDULER_CONFIG),
    "ddim": ("DDIMScheduler", DDIM_SCHEDULER_CONFIG),
}


def _write_scheduler(kind: str) -> Callable[[Path], None]:
    def write(out: Path) -> None:
        import diffusers

        cls_name, config = _SCHEDULERS[kind]
        # written as the published file is (PNDM's file carries ``clip_sample`` too);
        # loading it through the class checks it.
        data = {"_class_name": cls_name, "_diffusers_version": diffusers.__version__, **config}
        (out / "scheduler_config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        getattr(diffusers, cls_name).from_pretrained(out)

    return write


def _spec(component: str, cls: str, config: dict[str, Any] | None, dtype: Any, tiny: bool, seed: int) -> dict[str, Any]:
    return {
        "component": component,
        "class": cls,
        "config": config,
        "dtype": _dtype_name(_resolve_dtype(dtype)) if dtype is not None else None,
        "tiny": tiny,
        "seed": seed,
    }


def _with_marker(spec: dict[str, Any], write: Callable[[Path], None]) -> Callable[[Path], None]:
    """*write*, then the component's own marker (used for pipeline subfolders)."""

    def run(out: Path) -> None:
        t0 = time.perf_counter()
        write(out)
        _write_marker(out, spec, _config_hash(spec), time.perf_counter() - t0)

    return run


# --------------------------------------------------------------------------------------
# public builders
# --------------------------------------------------------------------------------------


def _unet_parts(dtype: Any, tiny: bool, seed: int) -> tuple[dict[str, Any], Callable[[Path], None]]:
    config = UNET_CONFIG_TINY if tiny else UNET_CONFIG
    spec = _spec("unet", "UNet2DConditionModel", config, dtype, tiny, seed)
    label = f"unet{' (tiny)' if tiny else ''} {_dtype_name(_resolve_dtype(dtype))}"
    return spec, _write_diffusers_model("UNet2DConditionModel", config, dtype, seed, label)


def _vae_parts(dtype: Any, tiny: bool, seed: int) -> tuple[dict[str, Any], Callable[[Path], None]]:
    config = VAE_CONFIG_TINY if tiny else VAE_CONFIG
    spec = _spec("vae", "AutoencoderKL", config, dtype, tiny, seed)
    label = f"vae{' (tiny)' if tiny else ''} {_dtype_name(_resolve_dtype(dtype))}"
    return spec, _write_diffusers_model("AutoencoderKL", config, dtype, seed, label)


def _text_encoder_parts(dtype: Any, tiny: bool, seed: int) -> tuple[dict[str, Any], Callable[[Path], None]]:
    config = TEXT_ENCODER_CONFIG_TINY if tiny else TEXT_ENCODER_CONFIG
    spec = _spec("text_encoder", "CLIPTextModel", config, dtype, tiny, seed)
    label = f"text_encoder{' (tiny)' if tiny else ''} {_dtype_name(_resolve_dtype(dtype))}"
    return spec, _write_text_encoder(config, dtype, seed, label)


def _tokenizer_parts() -> tuple[dict[str, Any], Callable[[Path], None]]:
    spec = _spec("tokenizer", "CLIPTokenizer", {**TOKENIZER_CONFIG, "vocab_size": _TOKENIZER_VOCAB_SIZE}, None, False, 0)
    return spec, _write_tokenizer


def _scheduler_parts(kind: str) -> tuple[dict[str, Any], Callable[[Path], None]]:
    if kind not in _SCHEDULERS:
        raise ValueError(f"unknown scheduler kind {kind!r}; choose one of {sorted(_SCHEDULERS)}")
    cls_name, config = _SCHEDULERS[kind]
    return _spec("scheduler", cls_name, config, None, False, 0), _write_scheduler(kind)


def build_unet(path: PathLike, *, dtype: torch.dtype | str = "float16", tiny: bool = False, seed: int = _DEFAULT_SEED) -> Path:
    """Build (once) a random-weight SD 1.5 ``UNet2DConditionModel`` directory at *path*.

    Args:
        path: directory to create (``config.json`` + ``diffusion_pytorch_model.safetensors``).
        dtype: dtype the weights are stored in (``torch.float16`` by default).
        tiny: same class and block layout with tiny channels (for tests).
        seed: seed of the random weights (same seed, same bytes).

    Returns:
        The absolute path. A directory already built with the same arguments is
        returned at once, untouched.
    """
    spec, write = _unet_parts(dtype, tiny, seed)
    return _build_atomic(path, spec, write)


def build_vae(path: PathLike, *, dtype: torch.dtype | str = "float16", tiny: bool = False, seed: int = _DEFAULT_SEED) -> Path:
    """Build (once) a random-weight SD 1.5 ``AutoencoderKL`` directory at *path*.

    Same arguments and behaviour as :func:`build_unet`.
    """
    spec, write = _vae_parts(dtype, tiny, seed)
    return _build_atomic(path, spec, write)


def build_text_encoder(
    path: PathLike, *, dtype: torch.dtype | str = "float16", tiny: bool = False, seed: int = _DEFAULT_SEED
) -> Path:
    """Build (once) a random-weight SD 1.5 ``CLIPTextModel`` directory at *path*.

    The tiny variant keeps the 49408-token vocabulary so that it works with the
    tokenizer of :func:`build_tokenizer`. Same arguments and behaviour as :func:`build_unet`.
    """
    spec, write = _text_encoder_parts(dtype, tiny, seed)
    return _build_atomic(path, spec, write)


def build_tokenizer(path: PathLike) -> Path:
    """Build (once) a CLIP tokenizer directory (``vocab.json``, ``merges.txt``, configs).

    The byte-level BPE vocabulary is generated locally (49408 tokens with CLIP's
    layout and special tokens, letter-sequence merges instead of learned ones); it
    loads with ``CLIPTokenizer.from_pretrained`` and tokenizes any text.
    """
    spec, write = _tokenizer_parts()
    return _build_atomic(path, spec, write)


def build_scheduler(path: PathLike, *, kind: str = "pndm") -> Path:
    """Build (once) the SD 1.5 scheduler configuration directory (``kind``: ``"pndm"`` or ``"ddim"``)."""
    spec, write = _scheduler_parts(kind)
    return _build_atomic(path, spec, write)


def build_controlnet(
    path: PathLike, *, dtype: torch.dtype | str = "float16", tiny: bool = False, seed: int = _DEFAULT_SEED
) -> Path:
    """Build (once) a random-weight SD 1.5 ``ControlNetModel`` directory at *path*.

    The tiny variant matches the tiny UNet (usable together in a
    ``StableDiffusionControlNetPipeline``). Same arguments and behaviour as :func:`build_unet`.
    """
    config = CONTROLNET_CONFIG_TINY if tiny else CONTROLNET_CONFIG
    spec = _spec("controlnet", "ControlNetModel", config, dtype, tiny, seed)
    label = f"controlnet{' (tiny)' if tiny else ''} {_dtype_name(_resolve_dtype(dtype))}"
    return _build_atomic(path, spec, _write_diffusers_model("ControlNetModel", config, dtype, seed, label))


def _model_index() -> dict[str, Any]:
    import diffusers

    return {
        "_class_name": "StableDiffusionPipeline",
        "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None],
        "image_encoder": [None, None],
        "requires_safety_checker": False,
        "safety_checker": [None, None],
        "scheduler": ["diffusers", "PNDMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }


def build_sd15_pipeline(
    path: PathLike, *, dtype: torch.dtype | str = "float16", tiny: bool = False, seed: int = _DEFAULT_SEED
) -> Path:
    """Build (once) a full ``StableDiffusionPipeline`` directory at *path*.

    Layout of the published SD 1.5 repository (``model_index.json``, ``unet/``,
    ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``) without safety checker
    and feature extractor (``requires_safety_checker: false``); loadable with
    ``StableDiffusionPipeline.from_pretrained(path)``. Each subfolder is itself a
    complete model directory (``UNet2DConditionModel.from_pretrained(path / "unet")``)
    carrying its own marker. Weights are stored in *dtype*; the components use
    different seeds derived from *seed*.
    """
    parts = {
        "unet": _unet_parts(dtype, tiny, seed),
        "vae": _vae_parts(dtype, tiny, seed + 1),
        "text_encoder": _text_encoder_parts(dtype, tiny, seed + 2),
        "tokenizer": _tokenizer_parts(),
        "scheduler": _scheduler_parts("pndm"),
    }
    spec = {
        "component": "sd15_pipeline",
        "class": "StableDiffusionPipeline",
        "config": {"model_index": {k: v for k, v in _model_index().items() if k != "_diffusers_version"}},
        "components": {name: _config_hash(sub_spec) for name, (sub_spec, _w) in parts.items()},
        "dtype": _dtype_name(_resolve_dtype(dtype)),
        "tiny": tiny,
        "seed": seed,
    }

    def write(out: Path) -> None:
        label = f"sd15 pipeline{' (tiny)' if tiny else ''} {_dtype_name(_resolve_dtype(dtype))}"
        _log(f"{label}: building components into {out}")
        for name, (sub_spec, sub_write) in parts.items():
            sub = out / name
            sub.mkdir()
            _with_marker(sub_spec, sub_write)(sub)
        (out / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n", encoding="utf-8")

    return _build_atomic(path, spec, write)
