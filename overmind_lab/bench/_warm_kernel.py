"""The warm-kernel case: kernel restarts, plain vs warm (forked from the zygote).

Through ``jupyter_client`` kernel managers (what a Jupyter server uses), with a private
daemon and a private zygote directory, for each kernelspec (the plain one and the warm
one, same interpreter and argv):

- ``restart_seconds``: from the restart request (``restart_kernel(now=False)``, as the
  server's restart handler) to the first ``kernel_info_reply``;
- ``cell_seconds``: the model's load cell right after the restart, imports included,
  with ``%overmind_load`` and a warm cache (the SD 1.5 pipeline; a Llama-style 1.1B causal
  LM in bf16);
- ``pss``: summed PSS of 4 idle kernels that imported torch, diffusers and transformers
  (for warm kernels, also with the zygote's own PSS added).

Medians of ``repeat`` restarts. Run: ``python -m overmind_lab.bench._warm_kernel``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

__all__ = ["build_llama", "run", "main"]

LLAMA_CONFIG: dict[str, Any] = dict(  # TinyLlama-1.1B's shape
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
)

SD_CELL = """\
%load_ext overmind_lab
%overmind_load
import torch
from diffusers import StableDiffusionPipeline
pipe = StableDiffusionPipeline.from_pretrained({path!r}, dtype=torch.float16)
"""

LLAMA_CELL = """\
%load_ext overmind_lab
%overmind_load
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16)
"""

IDLE_CELL = "import torch, diffusers, transformers\n"


def build_llama(path: Path, tiny: bool = False) -> Path:
    """A Llama-style causal LM with random weights in bf16, saved once at ``path``."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg: dict[str, Any] = dict(LLAMA_CONFIG)
    if tiny:
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        LlamaConfig(**cfg), dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def _spec(directory: Path, name: str, warm: bool) -> None:
    from overmind_lab._kernel.spec import kernel_json

    spec = kernel_json(name)
    if not warm:
        spec["metadata"].pop("kernel_provisioner")
    (directory / name).mkdir(parents=True, exist_ok=True)
    (directory / name / "kernel.json").write_text(json.dumps(spec))


class _Kernel:
    def __init__(self, name: str, env: dict[str, str], log: Any) -> None:
        from jupyter_client.manager import KernelManager

        self.env = env
        self.km = KernelManager(kernel_name=name)
        self.km.start_kernel(env=env, stdout=log, stderr=log, cwd="/tmp")
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=600)

    @property
    def warm(self) -> bool:
        return getattr(self.km.provisioner, "warm", None) is not None

    def restart(self) -> float:
        t0 = time.perf_counter()
        self.km.restart_kernel(now=False, env=self.env)
        self.kc.wait_for_ready(timeout=600)  # returns on the first kernel_info_reply
        return time.perf_counter() - t0

    def cell(self, code: str) -> float:
        t0 = time.perf_counter()
        reply = self.kc.execute_interactive(code, timeout=600, output_hook=lambda m: None)
        seconds = time.perf_counter() - t0
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {reply['content'].get('ename')}: "
                               f"{reply['content'].get('evalue')}")
        return seconds

    def pss(self) -> int:
        return _pss(int(getattr(self.km.provisioner, "pid", 0)))

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _wait_zygote(directory: Path, not_pid: int | None = None) -> dict[str, Any]:
    from overmind_lab._kernel.spec import zygotes

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for z in zygotes(directory):
            if z["pid"] != not_pid and not z["retiring"]:
                return z
        time.sleep(0.5)
    raise RuntimeError(f"no zygote became ready in {directory}")


def _case(name: str, cell: str, env: dict[str, str], repeat: int, log: Any,
          zdir: Path, progress: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("plain", "warm"):
        k = _Kernel(f"bench-{kind}", env, log)
        try:
            k.cell(cell)  # fills the cache (first case) and, for warm, teaches the zygote
            if kind == "warm":
                from overmind_lab._kernel.spec import restart_zygotes

                k.restart()  # the exit records the learned modules
                old = _wait_zygote(zdir)["pid"]
                restart_zygotes(zdir)  # a zygote with the cached classes and learned set
                _wait_zygote(zdir, not_pid=old)
            restarts, cells, warm = [], [], []
            for i in range(repeat):
                restarts.append(k.restart())
                warm.append(k.warm)
                cells.append(k.cell(cell))
                progress(f"{name} {kind} #{i + 1}: restart {restarts[-1]:.2f} s, "
                         f"cell {cells[-1]:.2f} s{' (warm kernel)' if k.warm else ''}")
            out[kind] = {"restart_seconds": _median(restarts), "cell_seconds": _median(cells),
                         "restart_all": restarts, "cell_all": cells, "forked": warm}
        finally:
            k.close()
    out["ratios"] = {
        "restart_warm_over_plain": out["warm"]["restart_seconds"] / out["plain"]["restart_seconds"],
        "cell_warm_over_plain": out["warm"]["cell_seconds"] / out["plain"]["cell_seconds"],
    }
    return out


def _memory(env: dict[str, str], log: Any, zdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("plain", "warm"):
        kernels = [_Kernel(f"bench-{kind}", env, log) for _ in range(4)]
        try:
            for k in kernels:
                k.cell(IDLE_CELL)
            time.sleep(1.0)
            out[f"{kind}_sum_bytes"] = sum(k.pss() for k in kernels)
            out[f"{kind}_forked"] = [k.warm for k in kernels]
            if kind == "warm":
                z = _wait_zygote(zdir)
                out["zygote_pss_bytes"] = _pss(int(z["pid"]))
        finally:
            for k in kernels:
                k.close()
    out["warm_over_plain"] = out["warm_sum_bytes"] / out["plain_sum_bytes"]
    out["warm_with_zygote_over_plain"] = (
        (out["warm_sum_bytes"] + out["zygote_pss_bytes"]) / out["plain_sum_bytes"])
    return out


def run(models_dir: Path, repeat: int = 5, tiny: bool = False,
        progress: Any = print) -> dict[str, Any]:
    from overmind_lab import Client
    from overmind_lab.bench import models as _models

    env = {k: v for k, v in os.environ.items() if not k.startswith("JPY_")}
    with tempfile.TemporaryDirectory(prefix="omwk-", dir="/tmp") as d:
        env.update(OVERMIND_LAB_SOCKET=f"{d}/d.sock", JUPYTER_PATH=f"{d}/share/jupyter",
                   PYDEVD_DISABLE_FILE_VALIDATION="1", TRANSFORMERS_VERBOSITY="error",
                   HF_HUB_OFFLINE="1")
        os.environ.update(env)
        kdir = Path(d, "share/jupyter/kernels")
        _spec(kdir, "bench-plain", warm=False)
        _spec(kdir, "bench-warm", warm=True)
        import torch

        sd = _models.build_sd15_pipeline(models_dir / ("tiny-sd15-fp16" if tiny else "sd15-fp16"),
                                         dtype=torch.float16, tiny=tiny)
        llama = build_llama(models_dir / ("tiny-llama-bf16" if tiny else "llama-1b-bf16"), tiny)
        client = Client(f"{d}/d.sock")
        client.start()
        result: dict[str, Any] = {"repeat": repeat, "tiny": tiny, "cpus": os.cpu_count(),
                                  "loadavg_start": os.getloadavg()}
        with open(Path(d, "kernels.log"), "ab") as log:
            try:
                # A first launch starts the zygote (and is plain: nothing was running).
                first = _Kernel("bench-warm", env, log)
                first.close()
                _wait_zygote(Path(d))
                result["sd15"] = _case("sd15", SD_CELL.format(path=str(sd)), env, repeat,
                                       log, Path(d), progress)
                result["llama"] = _case("llama", LLAMA_CELL.format(path=str(llama)), env,
                                        repeat, log, Path(d), progress)
                result["pss"] = _memory(env, log, Path(d))
            finally:
                client.stop()
                _kill_dir(d)
        result["loadavg_end"] = os.getloadavg()
    return result


def _kill_dir(marker: str) -> None:
    import signal

    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _report(r: dict[str, Any]) -> str:
    lines = [f"warm kernel benchmark: medians of {r['repeat']} restarts, {r['cpus']} CPUs, "
             f"load {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}"]
    for case in ("sd15", "llama"):
        c = r[case]
        lines.append(
            f"  {case}: restart -> kernel_info_reply plain {c['plain']['restart_seconds']:.2f} s, "
            f"warm {c['warm']['restart_seconds']:.2f} s "
            f"({c['ratios']['restart_warm_over_plain']:.2f}x); load cell after restart plain "
            f"{c['plain']['cell_seconds']:.2f} s, warm {c['warm']['cell_seconds']:.2f} s "
            f"({c['ratios']['cell_warm_over_plain']:.3f}x)")
    p = r["pss"]
    lines.append(f"  PSS of 4 idle kernels (torch, diffusers, transformers imported): plain "
                 f"{p['plain_sum_bytes'] / 2**20:.0f} MiB, warm {p['warm_sum_bytes'] / 2**20:.0f}"
                 f" MiB ({p['warm_over_plain']:.2f}x), warm + zygote "
                 f"{(p['warm_sum_bytes'] + p['zygote_pss_bytes']) / 2**20:.0f} MiB "
                 f"({p['warm_with_zygote_over_plain']:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overmind_lab.bench._warm_kernel",
                                     description=textwrap.dedent(__doc__ or "").strip())
    parser.add_argument("--models-dir", default=".models")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="tiny models (a quick check)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = run(Path(args.models_dir).absolute(), args.repeat, args.tiny, progress)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
