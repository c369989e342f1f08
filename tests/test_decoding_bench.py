"""``python -m benchmarks --quick --only decoding`` end to end, on the trained pair of the
decoding example (built once, shared with tests/test_decoding.py). Few prompts: the
structure and the exactness verdict are asserted, not the speedup."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _report
from tests.test_decoding import MODELS, REPO, decoding

pytestmark = [pytest.mark.slow,
              pytest.mark.timeout(2400)]  # builds the models when they are missing


def test_bench_quick_decoding(tmp_path: Path) -> None:
    decoding.build(MODELS)
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "decoding",
         "--models-dir", str(MODELS), "--out", str(out)],
        capture_output=True, text=True, timeout=1800, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["cases"] == ["decoding"]
    dec = results["decoding"]
    assert dec["exact"] is True and dec["mismatches"] == []
    lab = {"greedy", "speculative k=1", "speculative k=2", "speculative k=4",
           "speculative adaptive k<=12", "prompt lookup k=10", "self-speculative k=2 exit=2",
           "early exit"}
    transformers = {"transformers greedy", "transformers assisted (same draft)",
                    "transformers prompt lookup", "transformers early exit (layer 2)"}
    assert set(dec["tokens_per_second"]) | set(dec["transformers_failed"]) == lab | transformers
    assert lab <= set(dec["tokens_per_second"]) and "transformers greedy" in dec["tokens_per_second"]
    for name, spread in dec["spread"].items():
        assert spread["min"] <= spread["median"] <= spread["max"], name
    assert dec["transformers_best"] in transformers and dec["lab_best"] in lab
    assert dec["lab_over_transformers"] > 0
    # K was picked on the tuning prompts, not on the measured ones
    assert dec["tuning"]["prompts"] == 2 and dec["best_k"] in (1, 2, 4)
    assert dec["best_k"] == max((1, 2, 4), key=lambda k: dec["tuning"]["tokens_per_second"][str(k)])
    assert dec["loads"] and all(line.split()[0] in ("cold", "warm") for line in dec["loads"])
    assert 0 < dec["alpha"] < 1
    for k, row in dec["per_k"].items():
        assert row["predicted_tokens_per_round"] == pytest.approx(
            decoding.predicted_tokens_per_round(dec["alpha"], int(k)))
        assert 1 <= row["tokens_per_pass"] <= int(k) + 1
    # the single-prompt rows at K = 2 and K = 4: greedy, speculative, their ratio, alpha
    assert set(dec["single_prompt"]) == {"2", "4"}
    for k, row in dec["single_prompt"].items():
        assert row["greedy_tokens_per_second"] == dec["tokens_per_second"]["greedy"]
        assert row["speculative_tokens_per_second"] == dec["tokens_per_second"][f"speculative k={k}"]
        assert row["speedup"] == pytest.approx(
            row["speculative_tokens_per_second"] / row["greedy_tokens_per_second"])
        assert row["alpha"] == dec["per_k"][k]["alpha"]
    ee = dec["early_exit"]
    assert ee["calibration_agreement"] >= 0.95
    assert sum(ee["histogram"].values()) == 3 * 31  # 3 prompts, 32 tokens, the first is the prompt's
    assert 1 <= ee["average_layers"] <= 8
    assert dec["build"]["target"]["final_loss"] > 0
    [target] = [t for t in results["targets"] if t["id"] == "decoding_speedup"]
    assert target["value"] == dec["speedup"] and target["passed"] == (dec["speedup"] >= 1.5)
    [single] = [t for t in results["targets"] if t["id"] == "decoding_single_k4"]
    k4 = dec["single_prompt"]["4"]["speedup"]
    assert single["value"] == k4 and single["passed"] == (k4 >= 2.2)
    md = (out / "results.md").read_text()
    assert "## Decoding: speculative decoding and early exit" in md
    assert "| speculative k=4" in md and "Early exit at threshold" in md
    assert "| K | greedy tok/s | speculative tok/s | speculative / greedy | alpha |" in md
    assert "| transformers greedy" in md and "transformers' best" in md
    assert "tokens/s, greedy speculative decoding (best K) / greedy" in proc.stdout


def test_a_speedup_target_passes_at_or_above_its_limit() -> None:
    def verdict(speedup: float) -> bool | None:
        [t] = [t for t in _report.evaluate_targets({"decoding": {"speedup": speedup}})
               if t["id"] == "decoding_speedup"]
        assert t["unit"] == "x"
        return t["passed"]

    assert verdict(1.6) is True and verdict(1.5) is True and verdict(1.4) is False
    [t] = [t for t in _report.evaluate_targets({}) if t["id"] == "decoding_speedup"]
    assert t["value"] is None and t["passed"] is None
