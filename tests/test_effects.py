"""Registrations a load makes (Note [Registrations a load makes]): a warm
``AutoModel...(trust_remote_code=True)`` leaves transformers' Auto classes as a plain load does.

In-process: :class:`effects.Watch` sees an Auto class registration and ``record`` refuses one a
hit could not repeat. In real processes against a real daemon: after a warm hit of a model with
its own code, ``AutoModelForCausalLM.from_config(m.config)`` builds the model's class without a
prompt and ``save_pretrained`` writes the model's code files, as after a plain load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from overmind_lab import Client
from overmind_lab._errors import NotCacheable
from overmind_lab._loading import effects
from tests.conftest import TINY_LLAMA


def test_a_registration_is_recorded_and_replayed() -> None:
    from transformers import AutoConfig, LlamaConfig
    from transformers.models.auto import configuration_auto

    class EfConfig(LlamaConfig):
        model_type = "ef-local"

    with effects.Watch() as watch:
        AutoConfig.register("ef-local", EfConfig)
    try:
        assert len(watch.registered) == 1
        module, attr, _key, why = watch.registered[0]
        assert (module, attr) == (configuration_auto.__name__, "CONFIG_MAPPING")
        assert "is not a class, a function or a plain value" in why
        # A class defined in a function cannot be named in another process: not cached.
        with pytest.raises(NotCacheable, match="cannot register again"):
            watch.record([])
    finally:
        configuration_auto.CONFIG_MAPPING._extra_content.pop("ef-local", None)
    replayable = effects.Watch()
    replayable.registered = [[configuration_auto.__name__, "CONFIG_MAPPING", "ef-named",
                              {"ref": "transformers:LlamaConfig"}]]
    stored = json.loads(json.dumps(replayable.record([])))
    try:
        effects.replay(stored)
        assert configuration_auto.CONFIG_MAPPING["ef-named"] is LlamaConfig
    finally:
        configuration_auto.CONFIG_MAPPING._extra_content.pop("ef-named", None)


CONFIG_CODE = """
from transformers import LlamaConfig


class EfConfig(LlamaConfig):
    model_type = "ef-remote"
"""

MODEL_CODE = """
from transformers import LlamaForCausalLM

from .configuration_ef import EfConfig


class EfModel(LlamaForCausalLM):
    config_class = EfConfig
"""

SAVE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from efsrc.configuration_ef import EfConfig
from efsrc.modeling_ef import EfModel
EfConfig.register_for_auto_class()
EfModel.register_for_auto_class("AutoModelForCausalLM")
EfModel(EfConfig(**json.loads(sys.argv[3]))).save_pretrained(sys.argv[2])
"""

LOAD = """
import json, os, sys, overmind_lab
from transformers import AutoModelForCausalLM
with overmind_lab.record_loads() as events:
    model = overmind_lab.load(AutoModelForCausalLM.from_pretrained, sys.argv[1],
                              trust_remote_code=True)
again = AutoModelForCausalLM.from_config(model.config)  # no trust_remote_code: registered
model.save_pretrained(sys.argv[2])
print(json.dumps([events[-1].outcome, events[-1].reason, type(model).__name__,
                  type(again).__name__, type(model)._auto_class, sorted(n for n in os.listdir(sys.argv[2])
                                                  if n.endswith(".py"))]))
"""


def _run(*args: str, cwd: Path, env: dict[str, str]) -> Any:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else None


@pytest.mark.slow
def test_a_warm_model_with_its_own_code_is_registered(daemon: Client, tmp_path: Path) -> None:
    source = tmp_path / "efsrc"
    source.mkdir()
    (source / "__init__.py").write_text("")
    (source / "configuration_ef.py").write_text(CONFIG_CODE)
    (source / "modeling_ef.py").write_text(MODEL_CODE)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "save.py").write_text(SAVE)
    (tmp_path / "load.py").write_text(LOAD)
    _run(str(tmp_path / "save.py"), str(tmp_path), str(tmp_path / "model"), json.dumps(TINY_LLAMA),
         cwd=tmp_path, env=env)
    code = ["configuration_ef.py", "modeling_ef.py"]
    expected = ["EfModel", "EfModel", "AutoModelForCausalLM", code]
    for outcome, out in (("cold", "a"), ("warm", "b")):
        result = _run(str(tmp_path / "load.py"), str(tmp_path / "model"), str(tmp_path / out),
                      cwd=tmp_path, env=env)
        assert result[:1] + result[2:] == [outcome, *expected], result
