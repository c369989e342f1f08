"""Every decoding method on one prompt: the text each produces and its tokens per second.

::

    python examples/decoding/run.py                      # trains the pair once (~10 min)
    python examples/decoding/run.py --prompt "def read(" -n 96 -k 4

The models load through overmind-lab (``overmind_lab.patch_all()``), so a second run of
this script gets them warm from the daemon (started if none runs): the load line says
``cold`` or ``warm``. ``--plain`` loads without the cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("overmind_lab") is None:  # a checkout, not installed: use it
    sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=HERE.parents[1] / ".models",
                        help="where the pair is built (default: %(default)s)")
    parser.add_argument("--prompt", default="    def __init__(self, ",
                        help="the prompt (default: %(default)r)")
    parser.add_argument("-n", type=int, default=64, help="new tokens (default: %(default)s)")
    parser.add_argument("-k", type=int, default=4,
                        help="draft tokens per round (default: %(default)s)")
    parser.add_argument("--exit-layer", type=int, default=2,
                        help="layers of the self-speculative draft (default: %(default)s)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="early-exit threshold (default: calibrated for 95%% agreement)")
    parser.add_argument("--plain", action="store_true", help="load without overmind-lab")
    args = parser.parse_args(argv)

    import decoding
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    del LlamaForCausalLM  # imported now (seconds), so that the loads below time loading only

    target_dir, draft_dir = decoding.build(args.models)
    torch.set_num_threads(1)
    if args.plain:
        t0 = time.perf_counter()
        target = AutoModelForCausalLM.from_pretrained(target_dir)
        draft = AutoModelForCausalLM.from_pretrained(draft_dir)
        print(f"plain load of both models: {time.perf_counter() - t0:.2f} s")
    else:
        import overmind_lab

        overmind_lab.patch_all()
        with overmind_lab.record_loads() as events:
            target = AutoModelForCausalLM.from_pretrained(target_dir)
            draft = AutoModelForCausalLM.from_pretrained(draft_dir)
        for event in events:
            print(f"{event.summary()}  {event.name}")

    ids = decoding.encode(args.prompt)
    threshold = args.threshold
    if threshold is None:
        threshold, agreement = decoding.calibrate_threshold(
            target, decoding.prompts(4, seed=202), 32)
        print(f"early-exit threshold {threshold} (agreement {agreement:.3f} when calibrated)")
    methods = {
        "greedy": lambda: decoding.greedy(target, ids, args.n),
        f"speculative k={args.k}": lambda: decoding.speculative(target, draft, ids, args.n, args.k),
        "speculative adaptive k<=12 confidence=0.4": lambda: decoding.speculative(
            target, draft, ids, args.n, 12, confidence=0.4),
        "prompt lookup k=10": lambda: decoding.prompt_lookup(target, ids, args.n, 10),
        f"self-speculative k={args.k} exit={args.exit_layer}": lambda: decoding.self_speculative(
            target, ids, args.n, args.k, args.exit_layer),
        f"early exit {threshold}": lambda: decoding.early_exit(target, ids, args.n, threshold),
    }
    print(f"prompt: {args.prompt!r}")
    for name, method in methods.items():
        tokens, stats = method()
        extra = ""
        if stats["accepted"]:
            extra = f", {len(tokens) / stats['target_passes']:.2f} tokens per target pass"
        if name.startswith("early"):
            extra = f", {sum(stats['exit_layers'][1:]) / (args.n - 1):.2f} layers per token"
        print(f"\n{name}: {args.n / stats['seconds']:.0f} tok/s{extra}\n{decoding.decode(tokens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
