"""The ``decoding`` case: speculative decoding and early exit on the trained pair of the
decoding example (``examples/decoding/decoding.py``), tokens per second per method.

One child process (``python -m benchmarks._decoding SPEC``) does everything, with
one torch thread (single-token steps gain nothing from a second one, and lose a lot when
another process holds the other core):

1. builds the pair once under ``--models-dir`` (``decoding.build``: trains the target and
   the draft, about 10 minutes on 2 cores; later runs reuse them) and loads both with
   ``AutoModelForCausalLM.from_pretrained``;
2. times one forward step of the draft and of the target (1 token, and K+1 tokens for
   the verification) with their KV caches: what speculation can gain at most;
3. calibrates the early-exit threshold (one for all exits) on calibration prompts: the
   lowest of a grid at which at least 95% of the generated tokens equal the full model's;
4. on every held-out prompt, runs each method in turn (greedy, speculative for each K,
   self-speculative, early exit), so that drift of the machine hits all methods alike,
   and checks that the exact methods give the greedy tokens.

Reported: median tokens per second per method over the prompts; alpha (the per-token
acceptance estimated from all the speculative rounds) and, per K, the measured tokens
per target pass against (1 - alpha^(K+1)) / (1 - alpha); the best K and its speedup over
greedy; the single-prompt speedups at K = 2 and K = 4 (``single_prompt``: greedy and
speculative tokens per second, their ratio and alpha, each K on its own row); the
early-exit histogram, average layers, agreement and speedup.

This module imports torch only in the child.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["SPEEDUP_TARGET", "markdown", "run_decoding"]

#: Greedy speculative decoding (best K) over greedy decoding, tokens per second.
SPEEDUP_TARGET = 1.5
#: The Ks whose single-prompt speedup over greedy gets rows of its own (results.json's
#: ``single_prompt``, results.md's first table); every spec's ``ks`` includes them.
REPORTED_KS = (2, 4)
#: Agreement with the full model the early-exit threshold is calibrated for.
AGREEMENT = 0.95

#: The adaptive draft: at most ADAPTIVE_K tokens, stopping after one whose draft
#: probability is below CONFIDENCE (transformers' assistant_confidence_threshold is 0.4).
ADAPTIVE_K = 12
CONFIDENCE = 0.4

FULL = {"prompts": 12, "new_tokens": 64, "ks": [1, 2, 3, 4, 5, 6, 8], "self_ks": [2, 4],
        "exit_layers": [2, 4], "calibration_prompts": 6, "calibration_tokens": 48,
        "tuning_prompts": 6}
QUICK = {"prompts": 3, "new_tokens": 32, "ks": [1, 2, 4], "self_ks": [2], "exit_layers": [2],
         "calibration_prompts": 2, "calibration_tokens": 24, "tuning_prompts": 2}


def examples_dir() -> Path:
    """``examples/decoding`` of the checkout the suite runs from."""
    return Path(__file__).resolve().parents[1] / "examples" / "decoding"


def run_decoding(models_dir: Path, quick: bool, env: dict[str, str],
                 progress: Callable[[str], None], log_path: Path, timeout: float) -> dict[str, Any]:
    """Run the measuring child; returns its result (or ``{"error": ...}``)."""
    if not (examples_dir() / "decoding.py").exists():
        return {"error": f"{examples_dir() / 'decoding.py'} not found: the decoding case runs "
                         "from a source checkout"}
    spec = {"models_dir": str(models_dir), "quick": quick, **(QUICK if quick else FULL)}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks._decoding", json.dumps(spec)],
                                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                env=env, text=True)
        result: dict[str, Any] = {}
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                msg = json.loads(line)
                if "progress" in msg:
                    progress(f"decoding: {msg['progress']}")
                else:
                    result = msg
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        return {"error": f"the decoding child failed (exit {proc.returncode}); see {log_path}"}
    return result


def markdown(out: dict[str, Any]) -> list[str]:
    """The decoding section of ``results.md``."""
    lines = ["", "## Decoding: speculative decoding and early exit (examples/decoding)", ""]
    if out.get("error"):
        return lines + [f"Not measured: {out['error']}"]
    cfg, tps, ee = out["config"], out["tokens_per_second"], out["early_exit"]
    steps = out["step_seconds"]
    for name, b in out.get("build", {}).items():
        final = ("distilled from the target, final KL" if b.get("distilled") else "final loss")
        lines.append(f"- {name}: {(b.get('parameters') or 0) / 1e6:.2f}M parameters, trained "
                     f"{b.get('steps')} steps in {b.get('seconds') or 0:.0f} s; {final} "
                     f"{b.get('final_loss') or 0:.3f}, held out {(b.get('held_out_losses') or [0])[-1]:.3f} nats/byte")
    lines += [f"- loaded through the cache: {line}" for line in out.get("loads", [])]
    single = out.get("single_prompt") or {}
    if single:
        lines += ["", "Single prompt (batch 1), greedy verification (exact), medians over the "
                      "held-out prompts:", "",
                  "| K | greedy tok/s | speculative tok/s | speculative / greedy | alpha |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for k, row in single.items():
            lines.append(f"| {k} | {row['greedy_tokens_per_second']:.0f} | "
                         f"{row['speculative_tokens_per_second']:.0f} | {row['speedup']:.2f}x | "
                         f"{row['alpha']:.3f} |")
        lines.append("")
    lines += [f"- one step with a KV cache (median): target {steps['target']['1'] * 1e3:.2f} ms, draft "
              f"{steps['draft']['1'] * 1e3:.2f} ms ({out['step_cost_ratio']:.1f}x); target verifying "
              + ", ".join(f"{int(w) - 1}+1 tokens {s * 1e3:.2f} ms" for w, s in steps["target"].items()
                          if w != "1"), "",
              f"{cfg['prompts']} held-out prompts of 48 bytes, {cfg['new_tokens']} new tokens each; "
              "medians over the prompts, each method run on a prompt before the next prompt "
              "(interleaved), transformers' `generate` on the same pair and prompts. Exact methods "
              "(transformers' too) gave the greedy tokens on every prompt: "
              f"{'yes' if out['exact'] else '**NO**: ' + ', '.join(out['mismatches'])}.", "",
              "| method | tokens/s (median) | per prompt: min / q1 / q3 / max | vs greedy |",
              "| --- | ---: | ---: | ---: |"]
    alphas = out.get("alpha_by_method", {})
    spread = out.get("spread", {})
    for name, value in tps.items():
        alpha = f" (alpha {alphas[name]:.3f})" if name in alphas else ""
        sp = spread.get(name)
        rng = "-" if sp is None else f"{sp['min']:.0f} / {sp['q1']:.0f} / {sp['q3']:.0f} / {sp['max']:.0f}"
        lines.append(f"| {name}{alpha} | {value:.0f} | {rng} | {value / tps['greedy']:.2f}x |")
    for name, why in out.get("transformers_failed", {}).items():
        lines.append(f"| {name} | failed: {why} | | |")
    if out.get("transformers_best"):
        lines += ["", f"The lab's best exact method, {out['lab_best']}: {tps[out['lab_best']]:.0f} tok/s; "
                      f"transformers' best, {out['transformers_best']}: "
                      f"{tps[out['transformers_best']]:.0f} tok/s ({out['lab_over_transformers']:.2f}x)."]
    tuning = out.get("tuning", {})
    lines += ["", f"alpha (per-token acceptance, all K) = {out['alpha']:.3f}; K = {out['best_k']} "
                  f"picked on {tuning.get('prompts', '?')} tuning prompts (not the measured ones): "
                  f"{out['speedup']:.2f}x greedy on the measured prompts, target ≥ "
                  f"{out['speedup_target']:g}x.", "",
              "| K | alpha | tokens per target pass | per full round | predicted (1-α^(K+1))/(1-α) | speedup |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k, r in out["per_k"].items():
        full = "-" if r["tokens_per_full_round"] is None else f"{r['tokens_per_full_round']:.2f}"
        lines.append(f"| {k} | {r['alpha']:.3f} | {r['tokens_per_pass']:.2f} | {full} | "
                     f"{r['predicted_tokens_per_round']:.2f} | {r['speedup']:.2f}x |")
    hist = ", ".join(f"{layer}: {count}" for layer, count in ee["histogram"].items())
    lines += ["", f"Early exit at threshold {ee['threshold']:g} (calibrated: agreement "
                  f"{ee['calibration_agreement']:.3f} on the calibration prompts; "
                  f"{ee['agreement']:.3f} on these): {ee['average_layers']:.2f} of {out['layers']} "
                  f"layers on average, {ee['speedup']:.2f}x greedy. Exit layers: {hist}.", ""]
    return lines


# -- the child -------------------------------------------------------------------------------


def _say(**msg: Any) -> None:
    print(json.dumps(msg), flush=True)


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _step_costs(decoding: Any, model: Any, ks: list[int], repeat: int) -> dict[str, float]:
    """Median seconds of one forward with a KV cache: 1 token, and k+1 tokens for each k."""
    import torch

    out: dict[str, float] = {}
    with torch.inference_mode():
        run = decoding.Runner(model)
        cache = run.new_cache(128)
        run.forward(list(range(32, 80)), cache)
        for width in [1] + [k + 1 for k in ks]:
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                run.forward([32] * width, cache)
                times.append(time.perf_counter() - t0)
                cache.crop(48)
            out[str(width)] = _median(times)
    return out


def _load_pair(target_dir: Path, draft_dir: Path) -> tuple[Any, Any, list[str]]:
    """Both models through the cache (warm when an earlier run stored them), and a line
    per load (``cold 0.31 s ...``/``warm 0.02 s ...``)."""
    from transformers import AutoModelForCausalLM

    import overmind_lab

    with overmind_lab.record_loads() as events:
        target = overmind_lab.load(AutoModelForCausalLM.from_pretrained, str(target_dir))
        draft = overmind_lab.load(AutoModelForCausalLM.from_pretrained, str(draft_dir))
    return target.eval(), draft.eval(), [f"{e.summary()}  {e.name}" for e in events]


#: transformers' own methods on the same pair: name -> generate() keyword arguments.
def _transformers_methods(draft: Any, layers: int) -> dict[str, dict[str, Any]]:
    return {
        "transformers greedy": {},
        "transformers assisted (same draft)": {"assistant_model": draft},
        "transformers prompt lookup": {"prompt_lookup_num_tokens": 10},
        f"transformers early exit (layer {min(2, layers - 1)})": {
            "assistant_early_exit": min(2, layers - 1)},
    }


def _generate(target: Any, ids: Any, n: int, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """transformers' ``generate``, greedy, as the lab's methods are called."""
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(ids, max_new_tokens=n, do_sample=False,
                              pad_token_id=0, **kwargs)
    return out[0, ids.shape[1]:], {"seconds": time.perf_counter() - t0}


def _spread(values: list[float]) -> dict[str, float]:
    """Median and the per-prompt range (min, quartiles, max) of per-prompt values."""
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    return {"median": _median(ordered), "min": ordered[0], "q1": q[0], "q3": q[2],
            "max": ordered[-1]}


def _pick_k(decoding: Any, target: Any, draft: Any, prompts: list[Any], n: int,
            ks: list[int]) -> tuple[int, dict[str, float]]:
    """The K of the highest median tokens per second on *prompts* (tuning prompts, not the
    ones measured): Ks interleaved per prompt, like the measurement."""
    rates: dict[int, list[float]] = {k: [] for k in ks}
    for ids in prompts:
        for k in ks:
            _, stats = decoding.speculative(target, draft, ids, n, k)
            rates[k].append(n / stats["seconds"])
    medians = {k: _median(v) for k, v in rates.items()}
    return max(ks, key=lambda k: medians[k]), {str(k): v for k, v in medians.items()}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(examples_dir()))
    import decoding  # type: ignore[import-not-found]

    t0 = time.perf_counter()
    _say(progress=f"building (once) the target and the draft under {spec['models_dir']}")
    target_dir, draft_dir = decoding.build(spec["models_dir"])
    records = {name: decoding.read_marker(path) for name, path in
               (("target", target_dir), ("draft", draft_dir))}
    build = {name: {k: r.get(k) for k in ("seconds", "final_loss", "held_out_losses", "exit_losses",
                                          "parameters", "steps", "distilled")} for name, r in records.items() if r}
    build_wall = time.perf_counter() - t0
    target, draft, loads = _load_pair(target_dir, draft_dir)
    for line in loads:
        _say(progress=f"load: {line}")
    layers = int(target.config.num_hidden_layers)
    n, ks = int(spec["new_tokens"]), list(spec["ks"])

    _say(progress="timing one forward step of each model (KV cache)")
    costs = {"target": _step_costs(decoding, target, ks, 60), "draft": _step_costs(decoding, draft, [], 200)}
    cost_ratio = costs["target"]["1"] / costs["draft"]["1"]
    _say(progress=f"one step: target {costs['target']['1'] * 1e3:.2f} ms, draft "
                  f"{costs['draft']['1'] * 1e3:.2f} ms ({cost_ratio:.1f}x); target verifying 5 "
                  f"tokens {costs['target'].get('5', float('nan')) * 1e3:.2f} ms")

    calibration = decoding.prompts(spec["calibration_prompts"], seed=202)
    threshold, calib_agreement = decoding.calibrate_threshold(
        target, calibration, spec["calibration_tokens"], agreement=AGREEMENT)
    _say(progress=f"early-exit threshold {threshold} (agreement {calib_agreement:.3f} on "
                  f"{len(calibration)} calibration prompts)")
    # Note [K from held-out prompts]
    # The best K over the measured prompts is the maximum of noisy medians, biased upwards
    # (it was chosen for being high on exactly these prompts). K is picked on tuning
    # prompts of their own; the measured prompts only measure it.
    tuning = decoding.prompts(spec["tuning_prompts"], seed=303)
    tuned_k, tuning_medians = _pick_k(decoding, target, draft, tuning, n, ks)
    _say(progress=f"K = {tuned_k} picked on {len(tuning)} tuning prompts")

    # (function, keyword arguments): each is called as function(ids, **kwargs)
    methods: dict[str, tuple[Callable[..., tuple[Any, dict[str, Any]]], dict[str, Any]]] = {
        "greedy": (decoding.greedy, {"target": target, "n": n})}
    for k in ks:
        methods[f"speculative k={k}"] = (decoding.speculative,
                                         {"target": target, "draft": draft, "n": n, "k": k})
    methods[f"speculative adaptive k<={ADAPTIVE_K}"] = (
        decoding.speculative, {"target": target, "draft": draft, "n": n, "k": ADAPTIVE_K,
                               "confidence": CONFIDENCE})
    methods["prompt lookup k=10"] = (decoding.prompt_lookup, {"target": target, "n": n, "k": 10})
    for e in spec["exit_layers"]:
        for k in spec["self_ks"]:
            methods[f"self-speculative k={k} exit={e}"] = (
                decoding.self_speculative, {"target": target, "n": n, "k": k, "exit_layer": e})
    methods["early exit"] = (decoding.early_exit, {"target": target, "n": n, "thresholds": threshold})
    lab = list(methods)
    for name, kwargs in _transformers_methods(draft, layers).items():
        methods[name] = (_generate, {"target": target, "n": n, "kwargs": kwargs})

    prompts = decoding.prompts(spec["prompts"], seed=101)
    decoding.greedy(target, prompts[0], 8)  # warm-up
    _generate(target, prompts[0], 8, {})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
    failed: dict[str, str] = {}
    mismatches: list[str] = []
    agreement: list[float] = []
    for i, ids in enumerate(prompts):
        expected = torch.empty(0)
        for name, (method, kwargs) in methods.items():
            if name in failed:
                continue
            try:
                tokens, stats = method(ids=ids, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a transformers method this version lacks
                if name in lab:
                    raise
                failed[name] = f"{type(exc).__name__}: {exc}"
                _say(progress=f"{name}: {failed[name]}")
                continue
            runs[name].append({"tokens_per_second": n / stats["seconds"], **{
                key: stats[key] for key in ("accepted", "proposed", "tokens_per_pass",
                                            "exit_layers", "target_passes", "seconds")
                if key in stats}})
            if name == "greedy":
                expected = tokens
            elif name == "early exit":
                agreement.append(decoding.exit_agreement(target, ids, tokens))
            elif not torch.equal(tokens, expected):
                mismatches.append(f"{name} on prompt {i}")
        _say(progress=f"prompt {i + 1}/{len(prompts)}: greedy "
                      f"{runs['greedy'][-1]['tokens_per_second']:.0f} tok/s")
    runs = {name: rs for name, rs in runs.items() if rs}

    spread = {name: _spread([r["tokens_per_second"] for r in rs]) for name, rs in runs.items()}
    tps = {name: s["median"] for name, s in spread.items()}
    spec_runs = {k: runs[f"speculative k={k}"] for k in ks}
    alpha = decoding.acceptance_rate([r for rs in spec_runs.values() for r in rs])
    per_k = {}
    for k, rs in spec_runs.items():
        passes = sum(r["target_passes"] for r in rs)
        full_rounds = [t for r in rs for t, p in zip(r["tokens_per_pass"], r["proposed"], strict=True) if p == k]
        per_k[str(k)] = {
            "tokens_per_second": tps[f"speculative k={k}"],
            "speedup": tps[f"speculative k={k}"] / tps["greedy"],
            "alpha": decoding.acceptance_rate(rs),
            "tokens_per_pass": n * len(rs) / passes,
            # rounds cut short by the end of the n tokens draft fewer than k: left out here
            "tokens_per_full_round": statistics.fmean(full_rounds) if full_rounds else None,
            "predicted_tokens_per_round": decoding.predicted_tokens_per_round(alpha, k),
        }
    single_prompt = {str(k): {
        "greedy_tokens_per_second": tps["greedy"],
        "speculative_tokens_per_second": per_k[str(k)]["tokens_per_second"],
        "speedup": per_k[str(k)]["speedup"], "alpha": per_k[str(k)]["alpha"],
    } for k in REPORTED_KS if str(k) in per_k}
    exits = [layer for r in runs["early exit"] for layer in r["exit_layers"][1:]]  # [0]: the prompt
    histogram = {str(layer): exits.count(layer) for layer in range(1, layers + 1)}
    self_best = max((name for name in tps if name.startswith("self-")), key=lambda m: tps[m])
    exact_lab = [name for name in lab if name != "early exit"]
    # Note [Best against best]
    # Both sides' best is the highest median on the measured prompts, the same (upward)
    # bias on each side; the lab's side also gets K from the tuning prompts only.
    lab_best = max(exact_lab, key=lambda m: tps[m])
    hf = [name for name in tps if name.startswith("transformers")]
    hf_best = max(hf, key=lambda m: tps[m]) if hf else None
    return {
        "config": {k: v for k, v in spec.items()}, "layers": layers, "build": build, "loads": loads,
        "build_wall_seconds": build_wall, "step_seconds": costs, "step_cost_ratio": cost_ratio,
        "tokens_per_second": tps, "spread": spread, "runs": runs, "alpha": alpha, "per_k": per_k,
        "single_prompt": single_prompt, "best_k": tuned_k, "tuning": {"prompts": len(tuning), "tokens_per_second": tuning_medians},
        "speedup": per_k[str(tuned_k)]["speedup"], "speedup_target": SPEEDUP_TARGET,
        "alpha_by_method": {name: decoding.acceptance_rate(rs) for name, rs in runs.items()
                            if name in lab and runs[name][0].get("accepted")},
        "self_speculative_best": self_best, "self_speculative_speedup": tps[self_best] / tps["greedy"],
        "lab_best": lab_best, "transformers_best": hf_best, "transformers_failed": failed,
        "lab_over_transformers": tps[lab_best] / tps[hf_best] if hf_best else None,
        "early_exit": {
            "threshold": threshold, "calibration_agreement": calib_agreement,
            "agreement": statistics.fmean(agreement), "histogram": histogram,
            "average_layers": statistics.fmean(exits), "speedup": tps["early exit"] / tps["greedy"],
        },
        "exact": not mismatches, "mismatches": mismatches,
    }


def main() -> int:
    spec = json.loads(sys.argv[1])
    _say(**child(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
