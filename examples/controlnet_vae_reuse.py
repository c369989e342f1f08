"""Components passed into a pipeline are cached once: ``vae=vae``, ``controlnet=[a, b]``.

A common notebook pattern loads a VAE and two ControlNets by hand, then assembles a
``StableDiffusionControlNetPipeline`` around them. With overmind-lab each of the four
``from_pretrained`` calls is a cache entry; the pipeline's entry names the components by
their own keys and references their tensors instead of storing them again. Run this
script twice: the first run loads and caches, the second (a new process, like a restarted
kernel) gets everything warm, and the daemon's byte counts show that the VAE and the
ControlNets are held once.

Offline: the models are random-weight Stable Diffusion 1.5 components (the real
architecture) that the script builds once under ``--models``::

    python examples/controlnet_vae_reuse.py            # full size (about 3 GB in fp16)
    python examples/controlnet_vae_reuse.py --tiny     # a few MB, for a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# overmind_lab from the checkout where it is not installed; the model builders always from
# the checkout (benchmarks/, which the wheel does not ship)
if importlib.util.find_spec("overmind_lab") is None:
    sys.path.insert(0, str(HERE.parent))
else:
    sys.path.append(str(HERE.parent))


def build(models: Path, *, tiny: bool, dtype: str) -> dict[str, Path]:
    """The pipeline and two ControlNets on disk (built once, reused afterwards)."""
    from benchmarks import models as _models

    return {
        "sd15": _models.build_sd15_pipeline(models / "sd15", dtype=dtype, tiny=tiny),
        "canny": _models.build_controlnet(models / "controlnet-a", dtype=dtype, tiny=tiny,
                                          seed=11),
        "depth": _models.build_controlnet(models / "controlnet-b", dtype=dtype, tiny=tiny,
                                          seed=12),
    }


def load(paths: dict[str, Path], dtype: str) -> tuple[Any, list[Any]]:
    """The notebook cell, as a user writes it."""
    import torch
    from diffusers import (
        AutoencoderKL,
        ControlNetModel,
        StableDiffusionControlNetPipeline,
    )

    import overmind_lab

    torch_dtype = getattr(torch, dtype)
    with overmind_lab.record_loads() as events:
        vae = AutoencoderKL.from_pretrained(paths["sd15"], subfolder="vae", dtype=torch_dtype)
        controlnets = [
            ControlNetModel.from_pretrained(paths["canny"], dtype=torch_dtype),
            ControlNetModel.from_pretrained(paths["depth"], dtype=torch_dtype),
        ]
        pipe = StableDiffusionControlNetPipeline.from_pretrained(
            paths["sd15"], vae=vae, controlnet=controlnets, dtype=torch_dtype)
    # As without the cache, the pipeline holds the very objects passed in.
    assert pipe.vae is vae
    assert all(n is c for n, c in zip(pipe.controlnet.nets, controlnets, strict=True))
    return pipe, events


def report(events: list[Any]) -> dict[str, Any]:
    """Print what happened and what the daemon holds; return it as data."""
    from overmind_lab import Client
    from overmind_lab._common.display import describe_load, format_bytes, text_table

    for event in events:
        print(describe_load(event))
    client = Client()
    ours = {e.key for e in events}
    entries = [e for e in client.entries() if e["key"] in ours]
    print()
    print(text_table(
        ("entry", "own bytes", "uses bytes of other entries"),
        [(e["name"], format_bytes(e["bytes"]),
          format_bytes(e["shared_bytes"]) if e["shared_bytes"] else "-") for e in entries],
        right=(1, 2),
    ))
    status = client.status()
    print(f"\nthe daemon holds {format_bytes(status['cached_bytes'])} in "
          f"{status['entries']} entries")
    return {
        "outcomes": [e.outcome for e in events],
        "keys": [e.key for e in events],
        "entries": {e["key"]: {"name": e["name"], "bytes": e["bytes"],
                               "shared_bytes": e["shared_bytes"]} for e in entries},
        "cached_bytes": status["cached_bytes"],
    }


def tensor_bytes(module: Any) -> int:
    """Bytes of the distinct storages behind a module's parameters and buffers."""
    seen: dict[int, int] = {}
    for t in module.state_dict().values():
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=HERE.parent / ".models" / "controlnet",
                        help="where the example models are built (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a few MB)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "float32"),
                        help="dtype the weights are stored and loaded in")
    parser.add_argument("--json", action="store_true",
                        help="end with one JSON line of the outcomes and byte counts")
    args = parser.parse_args(argv)

    paths = build(args.models, tiny=args.tiny, dtype=args.dtype)  # before patching
    import overmind_lab

    overmind_lab.patch_all()
    pipe, events = load(paths, args.dtype)
    data = report(events)
    data["tensor_bytes"] = {
        "unet": tensor_bytes(pipe.unet), "text_encoder": tensor_bytes(pipe.text_encoder),
        "vae": tensor_bytes(pipe.vae),
        "controlnets": [tensor_bytes(n) for n in pipe.controlnet.nets],
    }
    if args.json:
        print(json.dumps(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
