"""What the benchmark measures: the model directories it builds and the load cases.

Two pipeline directories are built once and kept under ``--models-dir``: the Stable
Diffusion 1.5 architecture with random weights stored in fp16 (``sd15-fp16``) and in
fp32 (``sd15-fp32``); ``--quick`` uses the tiny variants (``tiny-sd15-*``). Each
component subfolder is a complete model directory, so the component cases load
``<pipeline>/unet`` etc. directly, as a user loads a standalone model.

Three more, for the cases users have besides a diffusers folder (``_more_models.py``):
a 1.1B-parameter Llama-style causal LM in bf16 (``llama-1b-bf16``), the fp16 UNet as a
``.bin`` pickle checkpoint (``sd15-fp16-unet-bin``) and the fp16 pipeline as one
single-file checkpoint for ``from_single_file`` (``sd15-fp16-single-file``); the last two
are derived from ``sd15-fp16``, which is built first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._more_models import SINGLE_FILE_NAME

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
    method: str = "from_pretrained"  # the class's loading method
    config_from: str | None = None  # a model key whose directory is passed as ``config=``
    #: Modules the load imports lazily (the concrete class behind an Auto class, the
    #: single-file converters): imported before the timed load, as in a session that
    #: has loaded once. Importing is the warm kernel's part (``--only warm-kernel``).
    imports: tuple[str, ...] = ()

    def path(self, dirs: dict[str, Path]) -> Path:
        base = dirs[self.model]
        return base / self.subfolder if self.subfolder else base

    def kwargs(self, dirs: dict[str, Path]) -> dict[str, Any]:
        """Arguments besides the path and dtype (JSON-able, for the measuring child)."""
        return {"config": str(dirs[self.config_from])} if self.config_from else {}


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
    Case("llama-1b", "Llama 1.1B causal LM bf16 -> bf16", "transformers:AutoModelForCausalLM",
         "llama", None, "bfloat16", "bfloat16",
         imports=("transformers.models.llama.modeling_llama",)),
    Case("unet-bin", "UNet .bin (pickle) fp16 -> fp16", _UNET, "unet-bin", None, "float16",
         "float16"),
    Case("single-file", "Pipeline single file fp16 -> fp16 (from_single_file)", _PIPE,
         "single-file", SINGLE_FILE_NAME, "float16", "float16", method="from_single_file",
         config_from="fp16", imports=("diffusers.loaders.single_file",
                                      "diffusers.loaders.single_file_utils")),
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
    "warm-scripts": "python SCRIPT vs overmind-lab run SCRIPT (forked from the zygote), start "
                    "to exit: a diffusers script loading the UNet, a transformers script loading "
                    "the Llama, -m pytest, print('hi'); and the fallback where no zygote serves",
    "restart-direct": "kernel restarts driven by jupyter_client's KernelManager directly (no "
                      "server: nbclient, papermill, VS Code): restart_kernel() -> UNet load "
                      "cell done, plain vs warm kernel vs the warm spec's launcher argv",
    "orders": "what a user waits for in the order they type it, fresh processes, each over plain: "
              "the UNet fp16 in notebook order (overmind_lab first) and script order (torch "
              "first), first call vs repeated, first load with the daemon running, with none "
              "(a login), after kill -9, a warm load right after the first; the cache's disk",
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
#: The pipeline whose UNet (fp16 stored, loaded fp16) the warm-scripts case's diffusers script loads.
WARM_SCRIPTS_MODEL = "fp16"
#: The pipeline whose UNet (fp16 stored, loaded fp16) the orders case loads.
ORDERS_MODEL = "fp16"


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
    return {"fp16": models_dir / f"{prefix}-fp16", "fp32": models_dir / f"{prefix}-fp32",
            "llama": models_dir / ("tiny-llama-bf16" if quick else "llama-1b-bf16"),
            "unet-bin": models_dir / f"{prefix}-fp16-unet-bin",
            "single-file": models_dir / f"{prefix}-fp16-single-file"}


#: Model keys built from another model's directory (built first).
_DERIVED_FROM = {"unet-bin": "fp16", "single-file": "fp16"}


def needed_models(names: list[str]) -> list[str]:
    """The model keys the cases need, in build order (sources before what derives)."""
    by_name = {c.name: c for c in CASES}
    needed = {by_name[n].model for n in names if n in by_name}
    needed |= {c.config_from for n in names
               if (c := by_name.get(n)) is not None and c.config_from is not None}
    if "pss" in names:
        needed.add(by_name[PSS_CASE].model)
    if "kernel-restart" in names:
        needed.add(by_name[KERNEL_CASE].model)
    if "warm-kernel" in names:
        needed |= {WARM_KERNEL_MODEL, "llama"}
    if "warm-scripts" in names:
        needed |= {WARM_SCRIPTS_MODEL, "llama"}
    if "restart-direct" in names:  # the warm-kernel case's pipeline, its UNet
        needed.add(WARM_KERNEL_MODEL)
    if "orders" in names:
        needed.add(ORDERS_MODEL)
    needed |= {_DERIVED_FROM[k] for k in needed if k in _DERIVED_FROM}
    return sorted(needed, key=lambda k: (k in _DERIVED_FROM, k))


_BUILD_SCRIPT = """
import json, sys, time
import torch
from benchmarks import models as _models
from benchmarks import _more_models
from pathlib import Path
spec = json.loads(sys.argv[1])
dirs = {k: Path(path) for k, (path, _dtype) in spec["models"].items()}
out = {}
for key, (path, dtype) in spec["models"].items():
    t0 = time.perf_counter()
    built = _models.is_built(path)
    if key == "llama":
        _more_models.build_llama(dirs[key], tiny=spec["tiny"])
    elif key == "unet-bin":
        _more_models.build_unet_bin(dirs[key], dirs["fp16"] / "unet")
    elif key == "single-file":
        _more_models.build_single_file(dirs[key], dirs["fp16"])
    else:
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
            "models": {k: (str(dirs[k]), {"fp32": "float32", "llama": "bfloat16"}.get(k, "float16"))
                       for k in keys}}
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
