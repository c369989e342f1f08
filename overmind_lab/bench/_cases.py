"""What the benchmark measures: the model directories it builds and the load cases.

Two pipeline directories are built once and kept under ``--models-dir``: the Stable
Diffusion 1.5 architecture with random weights stored in fp16 (``sd15-fp16``) and in
fp32 (``sd15-fp32``); ``--quick`` uses the tiny variants (``tiny-sd15-*``). Each
component subfolder is a complete model directory, so the component cases load
``<pipeline>/unet`` etc. directly, as a user loads a standalone model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ALL_NAMES", "CASES", "EXTRA_CASES", "Case", "build_models", "model_dirs", "select"]


@dataclass(frozen=True)
class Case:
    name: str
    title: str
    loader: str  # "module:Class"
    model: str  # "fp16" | "fp32": which pipeline directory
    subfolder: str | None  # component folder inside it, None for the whole pipeline
    dtype: str  # dtype asked of from_pretrained
    stored: str  # dtype of the files

    def path(self, dirs: dict[str, Path]) -> Path:
        base = dirs[self.model]
        return base / self.subfolder if self.subfolder else base


_UNET = "diffusers:UNet2DConditionModel"
_PIPE = "diffusers:StableDiffusionPipeline"

CASES: list[Case] = [
    Case("unet-fp16", "UNet fp16 -> fp16", _UNET, "fp16", "unet", "float16", "float16"),
    Case("unet-fp32-as-fp16", "UNet fp32 -> fp16", _UNET, "fp32", "unet", "float16", "float32"),
    Case("unet-fp32", "UNet fp32 -> fp32 (2x bytes)", _UNET, "fp32", "unet", "float32", "float32"),
    Case("vae", "VAE fp16 -> fp16", "diffusers:AutoencoderKL", "fp16", "vae", "float16", "float16"),
    Case("text-encoder", "CLIP text encoder fp16 -> fp16", "transformers:CLIPTextModel", "fp16",
         "text_encoder", "float16", "float16"),
    Case("pipeline-fp16", "Pipeline fp16 -> fp16", _PIPE, "fp16", None, "float16", "float16"),
    Case("pipeline-fp32-as-fp16", "Pipeline fp32 -> fp16", _PIPE, "fp32", None, "float16", "float32"),
]

#: Cases that are not a plain/first/warm load triple.
EXTRA_CASES = {
    "pss": "PSS of 4 processes holding the UNet (fp32 -> fp16): warm from the cache vs plain",
    "kernel-restart": "Jupyter kernel restart: the pipeline load cell, cold vs warm (ipykernel)",
    "rest-entries": "GET <base_url>/overmind-lab/api/v1/entries through a real Jupyter server "
                    "with 100 cache entries (no model needed)",
    "warm-kernel": "kernel restarts through a real Jupyter server, plain vs warm kernel "
                   "(forked from the zygote): restart latency, the SD 1.5 and Llama 1.1B load "
                   "cells after a restart, PSS of 4 idle kernels",
    "decoding": "speculative decoding and early exit on the decoding example's trained pair: "
                "tokens per second per method (trains the pair once under --models-dir)",
}
ALL_NAMES = [c.name for c in CASES] + list(EXTRA_CASES)
_GROUPS = {
    "unet": [c.name for c in CASES if c.name.startswith("unet")],
    "pipeline": [c.name for c in CASES if c.name.startswith("pipeline")],
    "loads": [c.name for c in CASES],
}

#: The case whose model the PSS and kernel-restart measurements use.
PSS_CASE = "unet-fp32-as-fp16"
KERNEL_CASE = "pipeline-fp32-as-fp16"
#: The pipeline the warm-kernel case loads (fp16 stored, loaded fp16).
WARM_KERNEL_MODEL = "fp16"


def select(only: list[str] | None) -> list[str]:
    """Case names chosen by ``--only`` (names or groups, comma-separated), in run order."""
    if not only:
        return list(ALL_NAMES)
    wanted: set[str] = set()
    for item in only:
        for name in (part.strip() for part in item.split(",")):
            if not name:
                continue
            if name in _GROUPS:
                wanted.update(_GROUPS[name])
            elif name in ALL_NAMES:
                wanted.add(name)
            else:
                raise ValueError(f"unknown case {name!r}; choose from {', '.join(ALL_NAMES)} "
                                 f"or the groups {', '.join(_GROUPS)}")
    return [name for name in ALL_NAMES if name in wanted]


def model_dirs(models_dir: Path, quick: bool) -> dict[str, Path]:
    prefix = "tiny-sd15" if quick else "sd15"
    return {"fp16": models_dir / f"{prefix}-fp16", "fp32": models_dir / f"{prefix}-fp32"}


def needed_models(names: list[str]) -> list[str]:
    by_name = {c.name: c for c in CASES}
    needed = {by_name[n].model for n in names if n in by_name}
    if "pss" in names:
        needed.add(by_name[PSS_CASE].model)
    if "kernel-restart" in names:
        needed.add(by_name[KERNEL_CASE].model)
    if "warm-kernel" in names:
        needed.add(WARM_KERNEL_MODEL)
    return sorted(needed)


_BUILD_SCRIPT = """
import json, sys, time
import torch
from overmind_lab.bench import models as _models
spec = json.loads(sys.argv[1])
out = {}
for key, (path, dtype) in spec["models"].items():
    t0 = time.perf_counter()
    built = _models.is_built(path)
    _models.build_sd15_pipeline(path, dtype=getattr(torch, dtype), tiny=spec["tiny"])
    marker = _models.read_marker(path) or {}
    out[key] = {"path": path, "dtype": dtype, "bytes": marker.get("bytes"),
                "reused": built, "seconds": time.perf_counter() - t0,
                "build_seconds": marker.get("build_seconds")}
print(json.dumps(out))
"""


def build_models(dirs: dict[str, Path], keys: list[str], quick: bool, timeout: float) -> dict[str, dict[str, Any]]:
    """Build (once) the pipeline directories in a child process (progress on stderr)."""
    spec = {"tiny": quick,
            "models": {k: (str(dirs[k]), "float16" if k == "fp16" else "float32") for k in keys}}
    env = dict(os.environ)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("DIFFUSERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _BUILD_SCRIPT, json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=None, stdin=subprocess.DEVNULL,
                          env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building the benchmark models failed (exit {proc.returncode})")
    return dict(json.loads(proc.stdout.decode().strip().splitlines()[-1]))
