"""The warm-equivalence corpus: load cases that must give, warm, what a plain load gives.

``build(root)`` writes small real-architecture models with ``save_pretrained`` (diffusers
and transformers, safetensors and ``.bin``, variants, subfolders, a pipeline, schedulers,
tokenizers); ``CASES`` names each load; ``run(root, phase)`` (in a child process) loads
every case plainly and through the cache and prints one JSON line per case with the
first difference, if any. Phase ``first`` loads cold then warm in the same process;
phase ``again`` (a fresh process) loads warm only. Verify mode is on in both.
"""

from __future__ import annotations

import json
import sys
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
GPT2 = dict(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0,
            eos_token_id=0)
BERT = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=32)


def build(root: Path) -> None:
    """Write every model of the corpus under ``root``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # diffusers' config advice
        _build(root)


def _build(root: Path) -> None:
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import (
        BertConfig,
        BertModel,
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTokenizer,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaModel,
    )

    from benchmarks.models import build_tokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), cross_attention_dim=32, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8)
    vae = AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
                        norm_num_groups=8)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=32,
                                        intermediate_size=37, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=77))
    pipe_dir = root / "sd"
    tokenizer = CLIPTokenizer.from_pretrained(build_tokenizer(pipe_dir / "tokenizer"))
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text, tokenizer=tokenizer,
        scheduler=DDIMScheduler(steps_offset=1), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipe.save_pretrained(pipe_dir)
    unet.save_pretrained(root / "unet-variant", variant="fp16")
    unet.save_pretrained(root / "unet-bin", safe_serialization=False)
    EulerDiscreteScheduler(num_train_timesteps=500).save_pretrained(root / "euler")

    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(root / "llama")
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(root / "llama-variant",
                                                          variant="v2")
    LlamaModel(LlamaConfig(**LLAMA)).save_pretrained(root / "llama-base")
    GPT2LMHeadModel(GPT2Config(**GPT2)).save_pretrained(root / "gpt2-bin",
                                                        safe_serialization=False)
    BertModel(BertConfig(**BERT)).save_pretrained(root / "bert")
    build_tokenizer(root / "clip-tokenizer")


def _cases(root: Path) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]:
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        DiffusionPipeline,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoTokenizer,
        BertModel,
        CLIPTextModel,
        CLIPTokenizer,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    sd, llama = root / "sd", root / "llama"
    eager = LlamaConfig.from_pretrained(llama)
    eager._attn_implementation = "eager"
    c: dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = {
        # diffusers models
        "unet subfolder": (UNet2DConditionModel.from_pretrained, (sd,), {"subfolder": "unet"}),
        "unet fp16": (UNet2DConditionModel.from_pretrained, (sd,),
                      {"subfolder": "unet", "dtype": torch.float16}),
        "unet variant": (UNet2DConditionModel.from_pretrained, (root / "unet-variant",),
                         {"variant": "fp16"}),
        "unet .bin": (UNet2DConditionModel.from_pretrained, (root / "unet-bin",), {}),
        "unet loading info": (UNet2DConditionModel.from_pretrained, (sd,),
                              {"subfolder": "unet", "output_loading_info": True}),
        "unet device_map cpu": (UNet2DConditionModel.from_pretrained, (sd,),
                                {"subfolder": "unet", "device_map": "cpu"}),
        "vae": (AutoencoderKL.from_pretrained, (sd,), {"subfolder": "vae"}),
        "text encoder": (CLIPTextModel.from_pretrained, (sd,), {"subfolder": "text_encoder"}),
        # schedulers and their configs
        "ddim scheduler": (DDIMScheduler.from_pretrained, (sd,), {"subfolder": "scheduler"}),
        "euler scheduler": (EulerDiscreteScheduler.from_pretrained, (root / "euler",), {}),
        # pipelines
        "pipeline": (StableDiffusionPipeline.from_pretrained, (sd,), {}),
        "pipeline fp16": (StableDiffusionPipeline.from_pretrained, (sd,),
                          {"dtype": torch.float16}),
        "pipeline generic": (DiffusionPipeline.from_pretrained, (sd,), {}),
        # transformers models
        "llama": (LlamaForCausalLM.from_pretrained, (llama,), {}),
        "llama bf16": (AutoModelForCausalLM.from_pretrained, (llama,),
                       {"dtype": torch.bfloat16}),
        "llama eager": (LlamaForCausalLM.from_pretrained, (llama,),
                        {"attn_implementation": "eager"}),
        "llama sdpa": (LlamaForCausalLM.from_pretrained, (llama,),
                       {"attn_implementation": "sdpa"}),
        "llama config=": (LlamaForCausalLM.from_pretrained, (llama,), {"config": eager}),
        "llama variant": (LlamaForCausalLM.from_pretrained, (root / "llama-variant",),
                          {"variant": "v2"}),
        "llama device_map cpu": (LlamaForCausalLM.from_pretrained, (llama,),
                                 {"device_map": "cpu"}),
        "llama loading info": (LlamaForCausalLM.from_pretrained, (llama,),
                               {"output_loading_info": True}),
        "gpt2 .bin": (GPT2LMHeadModel.from_pretrained, (root / "gpt2-bin",), {}),
        "bert": (BertModel.from_pretrained, (root / "bert",), {}),
        "bert auto": (AutoModel.from_pretrained, (root / "bert",), {}),
        # configs and tokenizers
        "auto config": (AutoConfig.from_pretrained, (llama,), {}),
        "clip tokenizer": (CLIPTokenizer.from_pretrained, (root / "clip-tokenizer",), {}),
        "auto tokenizer": (AutoTokenizer.from_pretrained, (sd,), {"subfolder": "tokenizer"}),
        # seeded loads that initialise missing weights
        "seeded new head": (LlamaForSequenceClassification.from_pretrained,
                            (root / "llama-base",), {"num_labels": 3}),
        "seeded mismatched sizes": (LlamaForCausalLM.from_pretrained, (llama,),
                                    {"vocab_size": 80, "ignore_mismatched_sizes": True}),
    }
    return c


def _outputs(obj: Any) -> list[Any]:
    """Forward passes of every model in a result (a model, a pipeline's components, a
    tuple with loading info) on fixed inputs: a hit must give them bit for bit."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    gen = torch.Generator().manual_seed(0)
    found: list[Any] = []
    parts = list(obj) if isinstance(obj, tuple) else [obj]
    parts += list(getattr(obj, "components", {}).values()) if hasattr(obj, "components") else []
    with torch.no_grad():
        for part in parts:
            if not isinstance(part, torch.nn.Module):
                continue
            dtype = next(part.parameters()).dtype
            if isinstance(part, UNet2DConditionModel):
                found.append(part(torch.randn(1, 4, 8, 8, generator=gen).to(dtype), 1,
                                  encoder_hidden_states=torch.randn(
                                      1, 4, 32, generator=gen).to(dtype)).sample)
            elif isinstance(part, AutoencoderKL):
                found.append(part.decode(torch.randn(1, 4, 4, 4, generator=gen).to(dtype)
                                         ).sample)
            elif hasattr(part, "config") and hasattr(part.config, "vocab_size"):
                ids = torch.arange(1, 9).view(1, 8) % min(part.config.vocab_size, 64)
                out = part(input_ids=ids)
                found.append(out[0] if isinstance(out, tuple) else next(iter(out.values())))
    return found


def _same_outputs(a: Any, b: Any) -> str | None:
    import torch

    try:
        oa, ob = _outputs(a), _outputs(b)
    except Exception as exc:  # noqa: BLE001 - a forward that fails differs from one that works
        return f"a forward pass raised {exc!r}"
    if len(oa) != len(ob) or not all(torch.equal(x, y) for x, y in zip(oa, ob, strict=True)):
        return "the outputs of a forward pass are not bit-identical"
    return None


def run(root: Path, phase: str) -> None:
    import torch

    import overmind_lab
    from overmind_lab._common.fingerprint import compare as difference
    from overmind_lab._loading.load import set_verify

    warnings.simplefilter("ignore")  # library chatter; VerifyMismatch is counted below
    set_verify(True)  # what OVERMIND_LAB_VERIFY=1 and patch_all(verify=True) switch on
    cases = _cases(root)
    vae = None
    for name, (fn, args, kwargs) in cases.items():
        outcomes = []
        mismatches: list[str] = []
        seed = zlib.crc32(name.encode()) % 1000
        torch.manual_seed(seed)
        with overmind_lab.bypass():
            plain = fn(*args, **kwargs)
        plain_after = torch.rand(1)
        found = None
        for _ in range(2 if phase == "first" else 1):
            torch.manual_seed(seed)
            with warnings.catch_warnings(record=True) as caught, \
                    overmind_lab.record_loads() as events:
                warnings.simplefilter("always", overmind_lab.VerifyMismatch)
                cached = overmind_lab.load(fn, *args, **kwargs)
            mismatches += [str(w.message) for w in caught
                           if issubclass(w.category, overmind_lab.VerifyMismatch)]
            outcomes.append(events[-1].outcome if events else "none")
            found = found or difference(cached, plain) or _same_outputs(cached, plain)
            if not torch.equal(torch.rand(1), plain_after):
                found = found or "the random stream after the load"
        if name == "vae":
            vae = cached
        print(json.dumps({"case": name, "outcomes": outcomes, "difference": found,
                          "mismatches": mismatches}), flush=True)
    # a pipeline with a component passed in, which came from the cache
    from diffusers import StableDiffusionPipeline

    overmind_lab.patch_all()
    with overmind_lab.bypass():
        plain = StableDiffusionPipeline.from_pretrained(root / "sd", vae=vae)
    outcomes, found = [], None
    for _ in range(2 if phase == "first" else 1):
        with overmind_lab.record_loads() as events:
            cached = StableDiffusionPipeline.from_pretrained(root / "sd", vae=vae)
        outcomes.append(events[-1].outcome if events else "none")
        found = found or difference(cached, plain) or (
            None if cached.vae is vae else "pipe.vae is not the vae passed in")
    print(json.dumps({"case": "pipeline with passed vae", "outcomes": outcomes,
                      "difference": found, "mismatches": []}), flush=True)


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2])
