"""A Stable Diffusion 1.5 single-file checkpoint, written from a diffusers pipeline directory.

Users download SD 1.5 as one ``.safetensors`` file in the original (LDM) layout and load
it with ``StableDiffusionPipeline.from_single_file``. Nothing may be downloaded here, so
the benchmark writes that file itself from the random-weight pipeline directory that
:func:`benchmarks.models.build_sd15_pipeline` built: the UNet, VAE and CLIP text
encoder tensors under their LDM names, the inverse of diffusers' own conversion
(``diffusers.loaders.single_file_utils.convert_ldm_*_checkpoint``). The tensors are the
same bytes, so a plain ``from_single_file(file, config=pipeline_dir)`` gives the
pipeline back (``tests/test_bench.py`` checks that on the tiny pipeline).

Only the layout of SD 1.x (a ``UNet2DConditionModel`` with cross-attention down/up
blocks, an ``AutoencoderKL`` and a ``CLIPTextModel``) is written; block counts and layers
per block come from the component configs, so the tiny variant works as well.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ldm_state_dict", "write_single_file"]

_UNET = "model.diffusion_model."
_VAE = "first_stage_model."
_CLIP = "cond_stage_model.transformer.text_model."

#: Inside a UNet resnet block: (LDM, diffusers).
_RESNET = (("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("out_layers.0", "norm2"),
           ("out_layers.3", "conv2"), ("emb_layers.1", "time_emb_proj"),
           ("skip_connection", "conv_shortcut"))
#: Inside the VAE's mid-block attention: (LDM, diffusers); LDM's are 1x1 convolutions.
_VAE_ATTN = (("norm.", "group_norm."), ("q.", "to_q."), ("k.", "to_k."), ("v.", "to_v."),
             ("proj_out.", "to_out.0."))


def _unet_prefixes(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(LDM prefix, diffusers prefix) pairs for the UNet, most specific first."""
    layers = int(config["layers_per_block"])
    n = len(config["block_out_channels"])
    down_attn = ["CrossAttn" in t for t in config["down_block_types"]]
    up_attn = ["CrossAttn" in t for t in config["up_block_types"]]
    pairs = [("time_embed.0.", "time_embedding.linear_1."),
             ("time_embed.2.", "time_embedding.linear_2."),
             ("input_blocks.0.0.", "conv_in."), ("out.0.", "conv_norm_out."),
             ("out.2.", "conv_out."),
             ("middle_block.0.", "mid_block.resnets.0."),
             ("middle_block.1.", "mid_block.attentions.0."),
             ("middle_block.2.", "mid_block.resnets.1.")]
    for i in range(n):
        for j in range(layers):
            block = (layers + 1) * i + j + 1
            pairs.append((f"input_blocks.{block}.0.", f"down_blocks.{i}.resnets.{j}."))
            if down_attn[i]:
                pairs.append((f"input_blocks.{block}.1.", f"down_blocks.{i}.attentions.{j}."))
        if i < n - 1:
            pairs.append((f"input_blocks.{(layers + 1) * (i + 1)}.0.op.",
                          f"down_blocks.{i}.downsamplers.0.conv."))
        for j in range(layers + 1):
            block = (layers + 1) * i + j
            pairs.append((f"output_blocks.{block}.0.", f"up_blocks.{i}.resnets.{j}."))
            if up_attn[i]:
                pairs.append((f"output_blocks.{block}.1.", f"up_blocks.{i}.attentions.{j}."))
        if i < n - 1:
            pairs.append((f"output_blocks.{(layers + 1) * i + layers}.{2 if up_attn[i] else 1}.",
                          f"up_blocks.{i}.upsamplers.0."))
    return pairs


def _vae_prefixes(config: dict[str, Any]) -> list[tuple[str, str]]:
    layers = int(config["layers_per_block"])
    n = len(config["block_out_channels"])
    pairs = [("norm_out.", "conv_norm_out."), ("mid.attn_1.", "mid_block.attentions.0."),
             ("mid.block_1.", "mid_block.resnets.0."), ("mid.block_2.", "mid_block.resnets.1.")]
    for i in range(n):
        for j in range(layers):
            pairs.append((f"down.{i}.block.{j}.", f"down_blocks.{i}.resnets.{j}."))
        if i < n - 1:
            pairs.append((f"down.{i}.downsample.", f"down_blocks.{i}.downsamplers.0."))
            pairs.append((f"up.{n - 1 - i}.upsample.", f"up_blocks.{i}.upsamplers.0."))
        for j in range(layers + 1):
            pairs.append((f"up.{n - 1 - i}.block.{j}.", f"up_blocks.{i}.resnets.{j}."))
    return pairs


def _rename(key: str, pairs: list[tuple[str, str]]) -> str:
    for ldm, hf in pairs:
        if key.startswith(hf):
            return ldm + key[len(hf):]
    return key


def _unet(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    pairs = _unet_prefixes(config)
    out = {}
    for key, value in state.items():
        new = _rename(key, pairs)
        if "resnets" in key:
            for ldm, hf in _RESNET:
                new = new.replace(f".{hf}.", f".{ldm}.")
        out[_UNET + new] = value
    return out


def _vae(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    pairs = _vae_prefixes(config)
    out = {}
    for key, value in state.items():
        side, _, rest = key.partition(".")  # "encoder" / "decoder" / "quant_conv" ...
        new = f"{side}.{_rename(rest, pairs)}" if side in ("encoder", "decoder") else key
        new = new.replace("conv_shortcut.", "nin_shortcut.")
        if "mid.attn_1." in new:
            for ldm, hf in _VAE_ATTN:
                new = new.replace(f"mid.attn_1.{hf}", f"mid.attn_1.{ldm}")
            if value.ndim == 2:  # linear in diffusers, 1x1 convolution in LDM
                value = value[:, :, None, None]
        out[_VAE + new] = value
    return out


def _clip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # transformers >= 5.6 saves CLIPTextModel flattened (no "text_model." prefix)
    return {_CLIP + key.removeprefix("text_model."): value for key, value in state.items()}


def _component(pipeline_dir: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    folder = pipeline_dir / name
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state, json.loads((folder / "config.json").read_text())


def ldm_state_dict(pipeline_dir: Path) -> dict[str, torch.Tensor]:
    """The pipeline's UNet, VAE and text encoder tensors under their LDM names."""
    unet, unet_config = _component(pipeline_dir, "unet")
    vae, vae_config = _component(pipeline_dir, "vae")
    clip, _ = _component(pipeline_dir, "text_encoder")
    return {**_unet(unet, unet_config), **_vae(vae, vae_config), **_clip(clip)}


def write_single_file(pipeline_dir: Path, out: Path) -> Path:
    """Write ``out`` (``.safetensors``) from ``pipeline_dir``, atomically; returns ``out``."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in ldm_state_dict(pipeline_dir).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out)
    return out
