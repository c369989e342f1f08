"""The random-weight SD 1.5 builders (``benchmarks.models``), tiny variants.

Every directory is loaded back through the real ``from_pretrained`` of diffusers /
transformers; the completion marker makes a second build a no-op (files untouched)
and an interrupted or damaged build is redone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from benchmarks import models as _models


def _mtimes(path: Path) -> dict[str, int]:
    return {
        str(p.relative_to(path)): p.stat().st_mtime_ns
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_full_configs_are_sd15() -> None:
    """The full-size configurations are the published SD 1.5 ones (spot checks)."""
    assert _models.UNET_CONFIG["block_out_channels"] == [320, 640, 1280, 1280]
    assert _models.UNET_CONFIG["cross_attention_dim"] == 768
    assert _models.UNET_CONFIG["down_block_types"][:3] == ["CrossAttnDownBlock2D"] * 3
    assert _models.UNET_CONFIG["up_block_types"][0] == "UpBlock2D"
    assert _models.VAE_CONFIG["block_out_channels"] == [128, 256, 512, 512]
    assert _models.TEXT_ENCODER_CONFIG["vocab_size"] == 49408
    assert _models.TEXT_ENCODER_CONFIG["hidden_act"] == "quick_gelu"
    assert _models.CONTROLNET_CONFIG["conditioning_embedding_out_channels"] == [16, 32, 96, 256]


def test_full_unet_architecture_on_meta() -> None:
    """The full UNet config gives the real SD 1.5 UNet: 686 tensors, 859.5M parameters."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**_models.UNET_CONFIG)
    assert len(unet.state_dict()) == 686
    assert sum(p.numel() for p in unet.parameters()) == 859_520_964


def test_tiny_unet_loads_and_is_idempotent(tmp_path: Path) -> None:
    from diffusers import UNet2DConditionModel

    path = _models.build_unet(tmp_path / "unet", dtype=torch.float16, tiny=True)
    assert path == (tmp_path / "unet").absolute()
    assert (path / "diffusion_pytorch_model.safetensors").is_file()
    assert _models.is_built(path)
    marker = _models.read_marker(path)
    assert marker is not None and marker["component"] == "unet" and marker["dtype"] == "float16"

    before = _mtimes(path)
    again = _models.build_unet(tmp_path / "unet", dtype=torch.float16, tiny=True)
    assert again == path
    assert _mtimes(path) == before, "a second build must not rewrite anything"

    unet = UNet2DConditionModel.from_pretrained(path, dtype=torch.float16)
    assert isinstance(unet, UNet2DConditionModel)
    assert unet.dtype == torch.float16
    assert unet.config.block_out_channels == tuple(_models.UNET_CONFIG_TINY["block_out_channels"]) or list(
        unet.config.block_out_channels
    ) == _models.UNET_CONFIG_TINY["block_out_channels"]
    weights = torch.cat([p.detach().float().flatten() for p in unet.parameters()])
    assert torch.isfinite(weights).all() and weights.std() > 0


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = _models.build_vae(tmp_path / "a", dtype=torch.float32, tiny=True, seed=3)
    b = _models.build_vae(tmp_path / "b", dtype=torch.float32, tiny=True, seed=3)
    c = _models.build_vae(tmp_path / "c", dtype=torch.float32, tiny=True, seed=4)
    name = "diffusion_pytorch_model.safetensors"
    assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / name).read_bytes() != (c / name).read_bytes()


def _stored_dtypes(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "diffusion_pytorch_model.safetensors"), framework="pt") as fh:
        return {str(fh.get_slice(name).get_dtype()) for name in fh.keys()}  # noqa: SIM118 - safe_open is not a dict


def test_changed_arguments_rebuild(tmp_path: Path) -> None:
    from diffusers import AutoencoderKL

    path = _models.build_vae(tmp_path / "vae", dtype=torch.float16, tiny=True)
    assert _stored_dtypes(path) == {"F16"}
    _models.build_vae(tmp_path / "vae", dtype=torch.float32, tiny=True)
    assert _models.read_marker(path)["dtype"] == "float32"  # type: ignore[index]
    assert _stored_dtypes(path) == {"F32"}
    assert AutoencoderKL.from_pretrained(path, dtype=torch.float32).dtype == torch.float32


def test_interrupted_build_is_redone(tmp_path: Path) -> None:
    """A leftover private build directory and a damaged finished one are both rebuilt."""
    # an interrupted build leaves only the private sibling directory
    partial = tmp_path / ".unet.partial"
    partial.mkdir()
    (partial / "diffusion_pytorch_model.safetensors").write_bytes(b"half")
    path = _models.build_unet(tmp_path / "unet", dtype=torch.float16, tiny=True)
    assert not partial.exists()
    assert _models.is_built(path)

    # a file truncated or removed after the marker was written
    weights = path / "diffusion_pytorch_model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(100)
    assert not _models.is_built(path)
    _models.build_unet(tmp_path / "unet", dtype=torch.float16, tiny=True)
    assert _models.is_built(path) and weights.stat().st_size > 100

    # a directory with the marker gone (half-written in place) is ours only when empty
    os.remove(path / _models.MARKER)
    with pytest.raises(FileExistsError):
        _models.build_unet(tmp_path / "unet", dtype=torch.float16, tiny=True)


def test_tiny_text_encoder_and_tokenizer(tmp_path: Path) -> None:
    from transformers import CLIPTextModel, CLIPTokenizer

    tok_path = _models.build_tokenizer(tmp_path / "tokenizer")
    te_path = _models.build_text_encoder(tmp_path / "text_encoder", dtype=torch.float16, tiny=True)
    tokenizer = CLIPTokenizer.from_pretrained(tok_path)
    assert len(tokenizer) == 49408
    assert tokenizer.model_max_length == 77
    ids = tokenizer("a photo of an astronaut riding a horse", padding="max_length", return_tensors="pt").input_ids
    assert ids.shape == (1, 77)
    assert ids[0, 0].item() == 49406 and 49407 in ids[0].tolist()
    vocab = json.loads((tok_path / "vocab.json").read_text(encoding="utf-8"))
    assert vocab["<|endoftext|>"] == 49407

    encoder = CLIPTextModel.from_pretrained(te_path, dtype=torch.float32)
    assert isinstance(encoder, CLIPTextModel)
    with torch.no_grad():
        out = encoder(ids).last_hidden_state
    assert out.shape == (1, 77, _models.TEXT_ENCODER_CONFIG_TINY["hidden_size"])
    assert torch.isfinite(out).all()


def test_scheduler_and_controlnet(tmp_path: Path) -> None:
    from diffusers import ControlNetModel, DDIMScheduler, PNDMScheduler

    pndm = PNDMScheduler.from_pretrained(_models.build_scheduler(tmp_path / "pndm"))
    assert pndm.config.beta_schedule == "scaled_linear" and pndm.config.skip_prk_steps
    ddim = DDIMScheduler.from_pretrained(_models.build_scheduler(tmp_path / "ddim", kind="ddim"))
    assert ddim.config.steps_offset == 1

    cn_path = _models.build_controlnet(tmp_path / "controlnet", dtype=torch.float16, tiny=True)
    assert _stored_dtypes(cn_path) == {"F16"}
    controlnet = ControlNetModel.from_pretrained(cn_path, dtype=torch.float16)
    assert isinstance(controlnet, ControlNetModel) and controlnet.dtype == torch.float16
    # it fits the tiny UNet (same blocks): usable in a StableDiffusionControlNetPipeline
    assert controlnet.config.block_out_channels == _models.UNET_CONFIG_TINY["block_out_channels"] or list(
        controlnet.config.block_out_channels) == _models.UNET_CONFIG_TINY["block_out_channels"]


def test_tiny_pipeline_loads_and_runs(tmp_path: Path) -> None:
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    path = _models.build_sd15_pipeline(tmp_path / "sd15", dtype=torch.float32, tiny=True)
    index = json.loads((path / "model_index.json").read_text(encoding="utf-8"))
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["requires_safety_checker"] is False
    before = _mtimes(path)
    _models.build_sd15_pipeline(tmp_path / "sd15", dtype=torch.float32, tiny=True)
    assert _mtimes(path) == before

    # each subfolder is a finished component directory on its own
    assert _models.is_built(path / "unet")
    UNet2DConditionModel.from_pretrained(path / "unet")

    pipe = StableDiffusionPipeline.from_pretrained(path, dtype=torch.float16)
    assert pipe.safety_checker is None
    assert pipe.unet.dtype == torch.float16
    assert pipe.text_encoder.dtype == torch.float16
    pipe32 = StableDiffusionPipeline.from_pretrained(path)
    out = pipe32("a red cube", num_inference_steps=1, height=32, width=32, output_type="np")
    assert out.images.shape == (1, 32, 32, 3)
