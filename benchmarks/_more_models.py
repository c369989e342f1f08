"""The benchmark's other model directories: the cases users have besides a diffusers folder.

- ``build_llama``: a Llama-style causal LM (TinyLlama-1.1B's shape; ``tiny=True``: a few
  MB) with random weights in bf16, loaded with ``AutoModelForCausalLM.from_pretrained``;
- ``build_unet_bin``: an SD 1.5 UNet saved as a ``.bin`` (pickle) checkpoint, the format
  of older checkpoints, which plain loading must read and copy (no ``mmap``);
- ``build_single_file``: the SD 1.5 pipeline as one LDM-layout ``.safetensors`` file, for
  ``StableDiffusionPipeline.from_single_file`` (``_single_file.py``).

Each is built once, atomically and idempotently, with the completion marker of
``models.py`` (a changed spec rebuilds it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import models
from benchmarks._single_file import write_single_file

__all__ = ["LLAMA_CONFIG", "SINGLE_FILE_NAME", "build_llama", "build_single_file",
           "build_unet_bin"]

LLAMA_CONFIG: dict[str, Any] = dict(  # TinyLlama-1.1B's shape
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
)
_LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)

#: The checkpoint's file name inside the ``build_single_file`` directory.
SINGLE_FILE_NAME = "sd15.safetensors"


def build_llama(path: Path, tiny: bool = False, seed: int = 0) -> Path:
    """A Llama-style causal LM, random weights in bf16, at ``path`` (built once)."""
    config = {**LLAMA_CONFIG, **(_LLAMA_TINY if tiny else {})}
    spec = models._spec("llama_causal_lm", "LlamaForCausalLM", config, "bfloat16", tiny, seed)

    def write(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        t0 = time.perf_counter()
        cfg = LlamaConfig(**config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
        n = models._materialise(model, torch.bfloat16, seed)
        model.config.dtype = torch.bfloat16
        models._log(f"llama{' (tiny)' if tiny else ''}: {n / 1e6:.0f}M parameters "
                    f"initialised as bfloat16 in {time.perf_counter() - t0:.1f} s")
        models._save_module("llama", model, out)

    return models._build_atomic(path, spec, write)


def _derived(path: Path, component: str, source: Path, label: str,
             write: Callable[[Path], object]) -> Path:
    """Build ``path`` from the built directory ``source``; rebuilt when ``source`` is."""
    spec = {"component": component, "from": str(source),
            "source_config": (models.read_marker(source) or {}).get("config_hash")}

    def run(out: Path) -> None:
        with models._bytes_ticker(f"{label}: saving", out):
            write(out)

    return models._build_atomic(path, spec, run)


def build_unet_bin(path: Path, unet_dir: Path) -> Path:
    """The UNet of ``unet_dir`` saved again as ``diffusion_pytorch_model.bin``."""
    def write(out: Path) -> None:
        from diffusers import UNet2DConditionModel

        model = UNet2DConditionModel.from_pretrained(unet_dir)  # type: ignore[no-untyped-call]
        model.save_pretrained(out, safe_serialization=False)

    return _derived(path, "unet_bin", unet_dir, "unet .bin", write)


def build_single_file(path: Path, pipeline_dir: Path) -> Path:
    """A directory holding ``SINGLE_FILE_NAME``: the pipeline in the LDM layout."""
    return _derived(path, "sd15_single_file", pipeline_dir, "single file",
                    lambda out: write_single_file(pipeline_dir, out / SINGLE_FILE_NAME))
