"""The benchmark's other models (``bench/_more_models.py``, ``bench/_single_file.py``): a
Llama causal LM, a ``.bin`` UNet and an SD 1.5 single-file checkpoint, each loaded back
through the library's own loader."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from benchmarks import _more_models, _single_file
from benchmarks import models as _models


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _models.build_sd15_pipeline(tmp_path_factory.mktemp("sd") / "sd15",
                                       dtype=torch.float16, tiny=True)


def _same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys(), set(sa) ^ set(sb)
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert differ == []


def test_a_single_file_checkpoint_loads_back_as_the_pipeline(tiny_pipeline: Path,
                                                             tmp_path: Path) -> None:
    from diffusers import StableDiffusionPipeline

    out = _more_models.build_single_file(tmp_path / "single", tiny_pipeline)
    file = out / _more_models.SINGLE_FILE_NAME
    assert _models.is_built(out)
    plain = StableDiffusionPipeline.from_pretrained(tiny_pipeline, dtype=torch.float16)
    single = StableDiffusionPipeline.from_single_file(str(file), config=str(tiny_pipeline),
                                                      dtype=torch.float16,
                                                      local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        _same_tensors(getattr(plain, name), getattr(single, name))
    mtime = file.stat().st_mtime_ns
    _more_models.build_single_file(tmp_path / "single", tiny_pipeline)
    assert file.stat().st_mtime_ns == mtime  # built once


@pytest.mark.parametrize("component", ["unet", "vae"])
def test_full_size_ldm_names_convert_back_to_every_diffusers_name(component: str) -> None:
    """The SD 1.5 sizes (on the meta device, no memory): diffusers' own LDM converter
    maps the names written for the single file back to the model's, shapes included."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders import single_file_utils as sfu

    cls, config = ((UNet2DConditionModel, _models.UNET_CONFIG) if component == "unet"
                   else (AutoencoderKL, _models.VAE_CONFIG))
    with torch.device("meta"):
        model = cls(**config)
    state = model.state_dict()
    if component == "unet":
        ldm = _single_file._unet(state, dict(model.config))
        back = sfu.convert_ldm_unet_checkpoint(ldm, dict(model.config))
    else:
        ldm = _single_file._vae(state, dict(model.config))
        back = sfu.convert_ldm_vae_checkpoint(ldm, dict(model.config))
    assert set(back) == set(state), set(back) ^ set(state)
    assert {k: tuple(v.shape) for k, v in back.items()} == {
        k: tuple(v.shape) for k, v in state.items()}


def test_a_bin_unet_loads_as_the_safetensors_one(tiny_pipeline: Path, tmp_path: Path) -> None:
    from diffusers import UNet2DConditionModel

    out = _more_models.build_unet_bin(tmp_path / "unet-bin", tiny_pipeline / "unet")
    assert (out / "diffusion_pytorch_model.bin").is_file()
    assert not list(out.glob("*.safetensors"))
    _same_tensors(UNet2DConditionModel.from_pretrained(out),
                  UNet2DConditionModel.from_pretrained(tiny_pipeline / "unet"))


def test_a_tiny_llama_is_a_bf16_causal_lm(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    out = _more_models.build_llama(tmp_path / "llama", tiny=True)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert type(model) is LlamaForCausalLM
    assert model.dtype == torch.bfloat16
    assert model.config.num_hidden_layers == 2
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 1000)
