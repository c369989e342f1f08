"""``overmind-lab bench PATH`` (``overmind_lab/measure.py``): a user's own model folder,
measured in new processes on a private daemon that is gone afterwards.

Run from a working directory outside the checkout, so ``benchmarks/`` (not shipped) cannot
be imported: the command must not need it. tests/test_install.py runs it from the wheel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from overmind_lab._errors import OvermindError
from overmind_lab.measure import detect

ROWS = ("plain from_pretrained", "first load, cached (cold)", "warm load",
        "warm load after a daemon restart")


def tiny_bert(path: Path) -> Path:
    """A random-weight BERT with a few-word tokenizer, as save_pretrained writes them."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    BertModel(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=32)).save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                               "hello", "world"]) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    return path


def check_output(stdout: str, outcomes: tuple[str, ...] = ("plain", "cold", "warm", "warm")
                 ) -> str:
    """The four rows with their numbers and outcomes; returns the private socket path."""
    assert "first touch" in stdout and "imports" in stdout and "load + touch" in stdout
    number = r"\d+(\.\d+)? (ms|s)"
    for label, outcome in zip(ROWS, outcomes, strict=True):
        [line] = [ln for ln in stdout.splitlines() if ln.startswith(label + "  ")]
        cells = re.split(r"\s{2,}", line[len(label):].strip())
        assert len(cells) == 5, line
        assert all(re.fullmatch(number, c) for c in cells[:4]), line
        assert cells[4] == outcome, line
    match = re.search(r"private daemon on (\S+)", stdout)
    assert match, stdout
    return match.group(1)


def no_daemon_on(socket: str) -> None:
    """No process has the private socket on its command line, and its folder is gone."""
    found = subprocess.run(["pgrep", "-f", socket], capture_output=True, text=True, check=False)
    assert found.stdout.strip() == "", f"left running: {found.stdout}"
    assert not Path(socket).parent.exists()


@pytest.mark.slow  # four rows of new processes, ~15 s
def test_bench_measures_a_model_folder(tmp_path: Path) -> None:
    model = tiny_bert(tmp_path / "bert")
    user_socket = tmp_path / "user-run" / "daemon.sock"
    env = dict(os.environ, OVERMIND_LAB_SOCKET=str(user_socket),
               XDG_CACHE_HOME=str(tmp_path / "xdg"))  # the user's cache: xdg/overmind-lab
    env.pop("PYTHONPATH", None)
    env.pop("OVERMIND_LAB_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "overmind_lab", "bench", str(model),
                           "--repeat", "1", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BertModel (transformers)" in proc.stdout
    no_daemon_on(check_output(proc.stdout))
    # the user's daemon and cache were never touched; the private cache beside it is gone
    assert not user_socket.exists() and list((tmp_path / "xdg").iterdir()) == []


def test_bench_says_what_is_wrong_with_a_path(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for path, message in ((tmp_path / "nope", f"{tmp_path / 'nope'} does not exist"),
                          (tmp_path / "empty", "cannot tell what")):
        proc = subprocess.run([sys.executable, "-m", "overmind_lab", "bench", str(path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("overmind-lab: ") and message in proc.stderr


def test_the_class_comes_from_the_folders_files(tmp_path: Path) -> None:
    def folder(name: str, files: dict[str, object]) -> Path:
        path = tmp_path / name
        path.mkdir()
        for file, data in files.items():
            (path / file).write_text(json.dumps(data))
        return path

    pipe = folder("pipe", {"model_index.json": {"_class_name": "StableDiffusionPipeline"}})
    unet = folder("unet", {"config.json": {"_class_name": "UNet2DConditionModel"}})
    llm = folder("llm", {"config.json": {"architectures": ["LlamaForCausalLM"]},
                         "tokenizer_config.json": {}})
    bare = folder("bare", {"config.json": {"model_type": "bert"}})
    tok = folder("tok", {"tokenizer_config.json": {}})
    assert detect(pipe) == ("diffusers", "DiffusionPipeline", "DiffusionPipeline")
    assert detect(unet) == ("diffusers", "UNet2DConditionModel", "UNet2DConditionModel")
    assert detect(llm) == ("transformers", "LlamaForCausalLM", "AutoModel")
    assert detect(bare) == ("transformers", "AutoModel", "AutoModel")
    assert detect(tok) == ("transformers", "AutoTokenizer", "AutoTokenizer")
    assert detect(llm, "AutoModelForCausalLM") == (
        "transformers", "AutoModelForCausalLM", "AutoModelForCausalLM")
    assert detect(tmp_path, "diffusers.AutoModel")[:2] == ("diffusers", "AutoModel")
    with pytest.raises(OvermindError, match="--class"):
        detect(tmp_path)


def test_the_command_does_not_import_the_benchmarks() -> None:
    # benchmarks/ is not in the wheel; measure.py and its child program must not need it
    source = Path(sys.modules["overmind_lab.measure"].__file__ or "").read_text()
    assert "benchmarks" not in source
    proc = subprocess.run([sys.executable, "-c",
                           "import sys, overmind_lab.cli, overmind_lab.measure\n"
                           "overmind_lab.cli.build_parser()\n"
                           "print(sorted(m for m in sys.modules if m.startswith('bench')))"],
                          capture_output=True, text=True, timeout=120, cwd="/", check=True)
    assert proc.stdout.strip() == "[]"
