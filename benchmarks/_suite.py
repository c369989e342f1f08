"""The benchmark run: build models, start the daemon, run the cases, write the reports.

This process never imports torch: models are built and every measurement is made in
child processes; this one only drives them, talks to the daemon and reads ``/proc``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import _cases, _report
from benchmarks._cases import CASES, KERNEL_CASE, PSS_CASE, Case
from benchmarks._memory import as_saved, drop_page_cache, read_smaps_rollup, warm_page_cache
from benchmarks._runner import (
    Child,
    ChildError,
    Timeouts,
    child_env,
    run_sequence,
)
from benchmarks._service import PrivateDaemon
from overmind_lab._common.sizes import meminfo

__all__ = ["run_bench"]

#: Processes holding the UNet at once in the PSS measurement (2 with --quick, to save time).
HOLDERS = 4
QUICK_HOLDERS = 2


class Progress:
    """``[bench mm:ss] message`` lines on stderr."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, message: str) -> None:
        elapsed = int(time.monotonic() - self.t0)
        print(f"[bench {elapsed // 60:02d}:{elapsed % 60:02d}] {message}", file=sys.stderr, flush=True)


def _fmt_s(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = bool(args.quick)
        self.repeat = max(1, args.repeat if args.repeat is not None else (2 if self.quick else 5))
        self.out = Path(args.out).expanduser().absolute()
        self.models_dir = Path(args.models_dir).expanduser().absolute()
        self.logs = self.out / "logs"
        self.batch = max(1, int(args.batch))
        load_timeout = args.timeout if args.timeout else (180.0 if self.quick else 900.0)
        self.timeouts = Timeouts(ready=180.0 if self.quick else 300.0, load=load_timeout, exit=60.0)
        self.progress = Progress()
        self.dirs = _cases.model_dirs(self.models_dir, self.quick)
        self.holders = QUICK_HOLDERS if self.quick else HOLDERS
        self.daemon: PrivateDaemon | None = None
        self.env: dict[str, str] = {}
        self.results: dict[str, Any] = {"meta": {}, "models": {}, "cases": {}, "errors": []}

    # -- helpers --------------------------------------------------------------------------
    def error(self, message: str) -> None:
        self.results["errors"].append(message)
        self.progress(f"ERROR {message}")

    def checkpoint(self) -> None:
        """Write what is known so far (a crash or ^C still leaves results.json)."""
        with contextlib.suppress(OSError):
            _report.write_json(self.results, self.out / "results.json")

    def evict_all(self) -> None:
        assert self.daemon is not None
        self.daemon.evict_all()

    def job(self, case: Case, mode: str, **extra: Any) -> dict[str, Any]:
        return {"mode": mode, "loader": case.loader, "path": str(case.path(self.dirs)),
                "dtype": case.dtype, "method": case.method, "kwargs": case.kwargs(self.dirs),
                "imports": list(case.imports),
                **extra}

    # -- load cases -----------------------------------------------------------------------
    def run_case(self, case: Case) -> dict[str, Any]:
        path = case.path(self.dirs)
        self.progress(f"{case.name}: {case.title} — reading {path} into the page cache")
        file_bytes = warm_page_cache([path])
        self.evict_all()
        # rounds of plain, first, warm (interleaved against drift), each from the model's files
        # as a save leaves them (``as_saved``); the last warm process also checks its object
        # against a plain load (after its timing). Then the rounds with the page cache dropped:
        # after them the files come back by readahead, unlike a save's.
        jobs: list[dict[str, Any]] = []
        private = self.daemon is not None and self.daemon.private
        for i in range(self.repeat):
            jobs.append(self.job(case, "plain"))
            jobs.append(self.job(case, "first"))
            jobs.append(self.job(case, "warm", check=(i == self.repeat - 1)))
            if private:
                jobs.append(self.job(case, "restart"))
        for _ in range(self.repeat if private else 0):
            jobs.append(self.job(case, "plain-cold"))
            jobs.append(self.job(case, "reboot"))
        counters = {"plain": 0, "first": 0, "warm": 0, "restart": 0, "plain-cold": 0,
                    "reboot": 0}

        def before_go(i: int) -> None:
            if jobs[i]["mode"] == "first":
                self.evict_all()
            if jobs[i]["mode"] in ("restart", "reboot"):
                daemon = self.daemon
                assert daemon is not None
                cold: list[str | os.PathLike[str]] = [path]
                if daemon.cache_dir:
                    cold.append(daemon.cache_dir)
                daemon.kill_and_restart(
                    before_start=(lambda: drop_page_cache(cold))
                    if jobs[i]["mode"] == "reboot" else None)
            if jobs[i]["mode"] == "plain-cold":
                drop_page_cache([path])
            if jobs[i]["mode"] == "plain":  # each round: the model's files as a save left them
                as_saved([path])

        def on_result(i: int, rec: dict[str, Any]) -> None:
            mode = jobs[i]["mode"]
            counters[mode] += 1
            if mode == "first" and self.daemon is not None:
                # The daemon's copy of a just-saved source (Note [A copy to serve]) is made
                # before the next processes start: they do not idle through it.
                self.daemon.wait_quiet()
            head = f"{case.name}: {mode} {counters[mode]}/{self.repeat}"
            if "error" in rec:
                self.error(f"{head}: {rec['error'].splitlines()[0] if rec['error'] else rec['error']}")
                self.progress(f"{head}: see {self.logs}")
                return
            extra = ""
            if not mode.startswith("plain"):
                extra = f", outcome {rec.get('outcome')}"
                expected = "cold" if mode == "first" else "warm"  # restart, reboot too
                if rec.get("outcome") != expected:
                    extra += f" (expected {expected}: {rec.get('load_event', {}).get('reason')})"
            if rec.get("check") is not None:
                extra += f", check {'pass' if rec['check'].get('passed') else 'FAIL'}"
            self.progress(f"{head}: load {_fmt_s(rec.get('load_seconds'))} "
                          f"(imports {_fmt_s(rec.get('import_seconds'))}, first touch "
                          f"{_fmt_s(rec.get('touch_seconds'))}{extra})")

        records = run_sequence(jobs, env=self.env, log_dir=self.logs, label=case.name,
                               timeouts=self.timeouts, batch=self.batch,
                               before_go=before_go, on_result=on_result)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in counters}
        for job, rec in zip(jobs, records):
            runs[job["mode"]].append(rec)
        check = next((r.get("check") for r in reversed(runs["warm"]) if r.get("check")), None)
        if check is None:
            self.error(f"{case.name}: the correctness check did not run")
        elif not check.get("passed"):
            self.error(f"{case.name}: warm object differs from a plain load: "
                       + "; ".join(check.get("failures", [])[:3]))
        entry = None
        keys = {r.get("cache_key") for r in runs["warm"] if r.get("cache_key")}
        with contextlib.suppress(Exception):
            for e in self.daemon.client().entries():  # type: ignore[union-attr]
                if e.get("key") in keys:
                    entry = {k: e.get(k) for k in ("key", "name", "bytes", "shared_bytes", "tensors",
                                                    "hits", "cold_seconds", "store_seconds",
                                                    "warm_seconds")}
        weight_bytes = next((r.get("storage_bytes") for r in runs["plain"] if r.get("storage_bytes")), None)
        result: dict[str, Any] = {
            "title": case.title, "path": str(path), "loader": case.loader, "stored_dtype": case.stored,
            "load_dtype": case.dtype, "file_bytes": file_bytes, "weight_bytes": weight_bytes,
            "tensors": next((r.get("tensors") for r in runs["plain"] if r.get("tensors")), None),
            "runs": runs, "check": check, "entry": entry,
        }
        _report.summarize(result)
        r = result["ratios"]
        self.progress(f"{case.name}: median plain {_fmt_s(result['stats']['plain']['load'] and result['stats']['plain']['load']['median'])}, "
                      f"first {_fmt_s(result['stats']['first']['load'] and result['stats']['first']['load']['median'])}, "
                      f"warm {_fmt_s(result['stats']['warm']['load'] and result['stats']['warm']['load']['median'])}; "
                      f"warm/plain {r['warm_over_plain'] and round(r['warm_over_plain'], 4)}, "
                      f"first/plain {r['first_over_plain'] and round(r['first_over_plain'], 2)} "
                      f"(stored/plain {r['first_stored_over_plain'] and round(r['first_stored_over_plain'], 2)}); "
                      f"load+touch: first/plain {r['first_total_over_plain'] and round(r['first_total_over_plain'], 2)}, "
                      f"warm/plain {r['warm_total_over_plain'] and round(r['warm_total_over_plain'], 3)}, "
                      f"restart/plain {r['restart_total_over_plain'] and round(r['restart_total_over_plain'], 3)}")
        return result

    # -- PSS --------------------------------------------------------------------------------
    def _hold(self, jobs: list[dict[str, Any]], label: str) -> tuple[list[Child], list[dict[str, Any]]]:
        """Start processes that load and then hold; returns them once all hold."""
        children = [Child(job, self.env, self.logs / f"{label}-{i + 1}.log", self.timeouts).start()
                    for i, job in enumerate(jobs)]
        held: list[dict[str, Any]] = []
        try:
            readies = [c.expect("ready", self.timeouts.ready) for c in children]
            for i, (child, ready) in enumerate(zip(children, readies)):
                child.send("go")
                msg = child.expect("holding", self.timeouts.load)
                held.append({**ready, **msg})
                self.progress(f"pss: {label} {i + 1}/{len(children)} holding "
                              f"(load {_fmt_s(msg.get('load_seconds'))}, outcome {msg.get('outcome', '-')})")
        except BaseException:
            for c in children:
                c.kill()
                c.finish()
            raise
        return children, held

    def _release(self, children: list[Child]) -> None:
        for c in children:
            with contextlib.suppress(ChildError):
                c.send("exit")
        for c in children:
            with contextlib.suppress(ChildError):
                c.expect("result", 30)
            c.finish()

    @staticmethod
    def _pss_of(children: list[Child]) -> list[dict[str, int]]:
        return [read_smaps_rollup(c.pid) for c in children]

    def run_pss(self) -> dict[str, Any]:
        case = next(c for c in CASES if c.name == PSS_CASE)
        path = case.path(self.dirs)
        n = self.holders
        self.progress(f"pss: {n} processes holding {case.title} ({path})")
        warm_page_cache([path])
        self.evict_all()
        out: dict[str, Any] = {"case": case.name, "path": str(path), "holders": n}
        # the runtime: processes with everything imported and nothing loaded
        idle = self.job(case, "idle", import_overmind=True)
        first, _ = self._hold([idle], "pss-runtime-alone")
        out["runtime_single"] = read_smaps_rollup(first[0].pid)
        out["runtime_single_bytes"] = out["runtime_single"].get("Pss")
        self._release(first)
        idlers, _ = self._hold([idle] * n, "pss-runtime")
        out["runtime"] = self._pss_of(idlers)
        self._release(idlers)
        out["runtime_sum_bytes"] = sum(p.get("Pss", 0) for p in out["runtime"])
        self.progress(f"pss: runtime {out['runtime_single_bytes'] / 1e6:.0f} MB alone, "
                      f"{out['runtime_sum_bytes'] / 1e6:.0f} MB for {n} processes")
        # warm holders: one process stores the entry, then 4 load it warm and read every weight
        primer = run_sequence([self.job(case, "first")], env=self.env, log_dir=self.logs,
                              label="pss-store", timeouts=self.timeouts)[0]
        if "error" in primer:
            raise RuntimeError(f"storing the UNet failed: {primer['error']}")
        holders, held = self._hold([self.job(case, "warm", hold=True)] * n, "pss-warm")
        try:
            out["warm"] = self._pss_of(holders)
            daemon_pid = self.daemon.pid() if self.daemon else None
            out["daemon"] = read_smaps_rollup(daemon_pid) if daemon_pid else None
        finally:
            self._release(holders)
        out["warm_outcomes"] = [h.get("outcome") for h in held]
        out["warm_sum_bytes"] = sum(p.get("Pss", 0) for p in out["warm"])
        out["one_copy_bytes"] = held[0].get("storage_bytes")
        checksums = {h.get("checksum") for h in held}
        self.evict_all()
        plain_holders, plain_held = self._hold([self.job(case, "plain", hold=True)] * n, "pss-plain")
        try:
            out["plain"] = self._pss_of(plain_holders)
        finally:
            self._release(plain_holders)
        out["plain_sum_bytes"] = sum(p.get("Pss", 0) for p in out["plain"])
        # where the memory is: anonymous (heap, converted tensors), file (libraries, mapped
        # safetensors; shared with any other process on the machine), shmem (the cache)
        out["breakdown"] = {
            group: {field: sum(p.get(field, 0) for p in out[group])
                    for field in ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Rss")}
            for group in ("runtime", "warm", "plain")
        }
        checksums |= {h.get("checksum") for h in plain_held}
        out["checksums_equal"] = len(checksums) == 1
        one = out["one_copy_bytes"] or 0
        out["ratio"] = out["warm_sum_bytes"] / (one + out["runtime_sum_bytes"])
        out["ratio_single_runtime"] = out["warm_sum_bytes"] / (one + n * (out["runtime_single_bytes"] or 0))
        out["plain_ratio"] = out["plain_sum_bytes"] / (one + out["runtime_sum_bytes"])
        if any(o != "warm" for o in out["warm_outcomes"]):
            self.error(f"pss: the holders' loads were {out['warm_outcomes']}, expected all warm")
        if not out["checksums_equal"]:
            self.error("pss: warm and plain holders summed to different weights")
        self.progress(f"pss: warm {out['warm_sum_bytes'] / 1e9:.2f} GB, plain {out['plain_sum_bytes'] / 1e9:.2f} GB, "
                      f"one copy {one / 1e9:.2f} GB; ratio {out['ratio']:.3f} (target <= 1.2)")
        return out

    # -- kernel restart ----------------------------------------------------------------------
    def run_kernel(self) -> dict[str, Any]:
        from benchmarks._kernel import run_kernel_restart

        case = next(c for c in CASES if c.name == KERNEL_CASE)
        path = case.path(self.dirs)
        self.progress(f"kernel-restart: {case.title} in a real ipykernel ({path})")
        warm_page_cache([path])
        assert self.daemon is not None
        return run_kernel_restart(path, case.dtype, self.env, self.evict_all,
                                  lambda: self.daemon.client().entries(),  # type: ignore[union-attr]
                                  self.progress, timeout=self.timeouts.load,
                                  log_path=self.logs / "kernel.log")

    # -- REST route --------------------------------------------------------------------------
    def run_rest_entries(self) -> dict[str, Any]:
        from benchmarks._rest import ENTRIES, LIMIT_SECONDS, run_rest_entries

        self.progress(f"rest-entries: GET overmind-lab/api/v1/entries with {ENTRIES} entries "
                      "through a real jupyter server")
        assert self.daemon is not None
        out = run_rest_entries(self.env, self.evict_all,
                               lambda: len(self.daemon.client().entries()),  # type: ignore[union-attr]
                               self.progress, self.logs, timeout=self.timeouts.load)
        st = out["stats"]
        self.progress(f"rest-entries: {st['n']} requests: median {_fmt_s(st['median'])}, "
                      f"p90 {_fmt_s(st['p90'])}, max {_fmt_s(st['max'])} "
                      f"(target median <= {LIMIT_SECONDS * 1000:g} ms: "
                      f"{'pass' if out['passed'] else 'FAIL'})")
        return out

    # -- warm kernels ------------------------------------------------------------------------
    def run_warm_kernel(self) -> dict[str, Any]:
        from benchmarks._warm_kernel import run_warm_kernel

        path = self.dirs[_cases.WARM_KERNEL_MODEL]
        self.progress(f"warm-kernel: plain vs warm kernels through a real jupyter server ({path})")
        warm_page_cache([path])
        out = run_warm_kernel(path, self.dirs["llama"], self.quick, self.repeat, self.env,
                              self.progress, self.logs, timeout=self.timeouts.load)
        for name in ("sd15", "llama"):
            c = out[name]
            self.progress(f"warm-kernel: {name}: restart -> kernel_info_reply plain "
                          f"{_fmt_s(c['plain']['restart_seconds'])}, warm "
                          f"{_fmt_s(c['warm']['restart_seconds'])}; cell after the restart plain "
                          f"{_fmt_s(c['plain']['cell_seconds'])}, warm "
                          f"{_fmt_s(c['warm']['cell_seconds'])} "
                          f"({c['ratios']['cell_warm_over_plain']:.3f}x)")
            if not all(c["warm"]["forked"]):
                self.error(f"warm-kernel: {name}: a warm restart was not forked from the zygote")
        p = out["pss"]
        self.progress(f"warm-kernel: PSS of {p['kernels']} idle kernels: plain "
                      f"{p['plain_sum_bytes'] / 2**20:.0f} MiB, warm {p['warm_sum_bytes'] / 2**20:.0f} "
                      f"MiB = {p['warm_in_plain_kernels']:.2f} plain kernels (+ zygote, standbys: "
                      f"{p['warm_with_zygote_in_plain_kernels']:.2f})")
        if not all(p["warm_forked"]):
            self.error("warm-kernel: an idle warm kernel was not forked from the zygote")
        return out

    # -- warm scripts --------------------------------------------------------------------------
    def run_warm_scripts(self) -> dict[str, Any]:
        from benchmarks._warm_scripts import run_warm_scripts

        unet = self.dirs[_cases.WARM_SCRIPTS_MODEL] / "unet"
        llama = self.dirs["llama"]
        self.progress(f"warm-scripts: python SCRIPT vs overmind-lab run SCRIPT ({unet}, {llama})")
        warm_page_cache([unet, llama])
        out = run_warm_scripts(unet, llama, self.repeat, self.env, self.progress, self.logs,
                               timeout=self.timeouts.load)
        for message in out["errors"]:
            self.error(f"warm-scripts: {message}")
        return out

    # -- restarts through jupyter_client directly ------------------------------------------------
    def run_restart_direct(self) -> dict[str, Any]:
        from benchmarks._restart_direct import run_restart_direct

        unet = self.dirs[_cases.WARM_KERNEL_MODEL] / "unet"
        self.progress(f"restart-direct: restart_kernel() -> UNet cell done through "
                      f"jupyter_client's KernelManager, no server ({unet})")
        warm_page_cache([unet])
        out = run_restart_direct(unet, self.quick, self.repeat, self.env, self.progress,
                                 self.logs, timeout=self.timeouts.load)
        for message in out["errors"]:
            self.error(f"restart-direct: {message}")
        return out

    # -- orders --------------------------------------------------------------------------------
    def run_orders(self) -> dict[str, Any]:
        from benchmarks._orders import run_orders

        unet = self.dirs[_cases.ORDERS_MODEL] / "unet"
        self.progress(f"orders: what a user waits for in the order they type it ({unet})")
        warm_page_cache([unet])
        assert self.daemon is not None
        # a round is 7 fresh processes: --quick without --repeat runs one (well under a minute)
        rounds = 1 if self.quick and self.args.repeat is None else self.repeat
        out = run_orders(self.daemon, unet, rounds, self.env, self.progress, self.logs,
                         self.timeouts)
        for message in out["errors"]:
            self.error(f"orders: {message}")
        return out

    # -- decoding ----------------------------------------------------------------------------
    def run_decoding(self) -> dict[str, Any]:
        from benchmarks._decoding import run_decoding

        self.progress("decoding: speculative decoding and early exit (examples/decoding)")
        out = run_decoding(self.models_dir, self.quick, self.env, self.progress,
                           self.logs / "decoding.log", timeout=7200.0)
        if "error" not in out:
            ee = out["early_exit"]
            self.progress(f"decoding: greedy {out['tokens_per_second']['greedy']:.0f} tok/s; best K "
                          f"{out['best_k']}: {out['speedup']:.2f}x (alpha {out['alpha']:.3f}); "
                          f"early exit {ee['speedup']:.2f}x at {ee['average_layers']:.2f} layers")
            if not out["exact"]:
                self.error(f"decoding: output differs from greedy: {', '.join(out['mismatches'][:3])}")
        return out

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> int:
        try:
            names = _cases.select(self.args.only)
        except ValueError as exc:
            print(f"python -m benchmarks: {exc}", file=sys.stderr)
            return 2
        self.out.mkdir(parents=True, exist_ok=True)
        if self.logs.exists():
            shutil.rmtree(self.logs, ignore_errors=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        started = time.time()
        mem = meminfo()
        from overmind_lab import __version__

        self.results["meta"] = {
            "started": started,
            "started_iso": datetime.fromtimestamp(started, timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "quick": self.quick, "repeat": self.repeat, "batch": self.batch, "cases": names,
            "models_dir": str(self.models_dir), "out": str(self.out),
            "python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "memory_total_bytes": mem.get("MemTotal"),
            "torch": _version("torch"), "diffusers": _version("diffusers"),
            "transformers": _version("transformers"), "overmind_lab": __version__,
            "argv": sys.argv, "loadavg_start": _loadavg(),
        }
        self.progress(f"benchmarks{' --quick' if self.quick else ''}: {len(names)} cases, "
                      f"{self.repeat} runs per mode; results in {self.out}")
        needed = _cases.needed_models(names)
        if needed:  # rest-entries alone needs no model
            self.progress(f"models: building (once) {', '.join(str(self.dirs[k]) for k in needed)}")
            try:
                self.results["models"] = _cases.build_models(self.dirs, needed, self.quick,
                                                             timeout=3600.0)
            except Exception as exc:  # noqa: BLE001
                self.error(f"models: {exc}")
                self.checkpoint()
                return 1
        for key, info in self.results["models"].items():
            how = "reused" if info.get("reused") else f"built in {info['seconds']:.0f} s"
            self.progress(f"models: {key}: {info['path']} ({(info.get('bytes') or 0) / 1e9:.2f} GB, {how})")

        self.daemon = PrivateDaemon(self.args.socket, self.logs / "daemon.log", budget=self.args.budget)
        try:
            status = self.daemon.start()
            self.results["meta"].update(socket=self.daemon.socket, private_daemon=self.daemon.private,
                                        daemon_pid=status.get("pid"),
                                        daemon_budget_bytes=status.get("budget_bytes"),
                                        daemon_version=status.get("version"))
            self.progress(f"daemon: {'private' if self.daemon.private else 'existing'} on {self.daemon.socket} "
                          f"(pid {status.get('pid')})")
            self.env = child_env(self.daemon.socket)
            for name in names:
                case = next((c for c in CASES if c.name == name), None)
                if case is None:
                    continue
                try:
                    self.results["cases"][name] = self.run_case(case)
                except Exception as exc:  # noqa: BLE001
                    self.error(f"{name}: {type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    self.evict_all()
                self.checkpoint()
            if "pss" in names:
                try:
                    self.results["pss"] = self.run_pss()
                except Exception as exc:  # noqa: BLE001
                    self.results["pss"] = {"error": f"{type(exc).__name__}: {exc}"}
                    self.error(f"pss: {exc}")
                with contextlib.suppress(Exception):
                    self.evict_all()
                self.checkpoint()
            if "kernel-restart" in names:
                kr = self.run_kernel()
                self.results["kernel_restart"] = kr
                if kr.get("error"):
                    self.error(f"kernel-restart: {kr['error']}")
                elif kr.get("skipped"):
                    self.progress(f"kernel-restart: skipped: {kr.get('note')}")
                else:
                    self.progress(f"kernel-restart: cell plain {_fmt_s(kr['plain']['cell_seconds'])}, "
                                  f"cold {_fmt_s(kr['cold']['cell_seconds'])}, warm "
                                  f"{_fmt_s(kr['warm']['cell_seconds'])} (load statement "
                                  f"{_fmt_s(kr['plain'].get('load_seconds'))} -> "
                                  f"{_fmt_s(kr['warm'].get('load_seconds'))})")
                    if not kr.get("warm_from_cache"):
                        self.error("kernel-restart: the load after the restart was not a cache hit")
                with contextlib.suppress(Exception):
                    self.evict_all()
            if "rest-entries" in names:
                try:
                    rest = self.run_rest_entries()
                except Exception as exc:  # noqa: BLE001
                    rest = {"error": f"{type(exc).__name__}: {exc}"}
                    self.error(f"rest-entries: {rest['error']}")
                self.results["rest_entries"] = rest
                with contextlib.suppress(Exception):
                    self.evict_all()
                self.checkpoint()
            if "warm-kernel" in names:
                try:
                    self.results["warm_kernel"] = self.run_warm_kernel()
                except Exception as exc:  # noqa: BLE001
                    self.results["warm_kernel"] = {"error": f"{type(exc).__name__}: {exc}"}
                    self.error(f"warm-kernel: {type(exc).__name__}: {exc}")
                self.checkpoint()
            if "warm-scripts" in names:
                try:
                    self.results["warm_scripts"] = self.run_warm_scripts()
                except Exception as exc:  # noqa: BLE001
                    self.results["warm_scripts"] = {"error": f"{type(exc).__name__}: {exc}"}
                    self.error(f"warm-scripts: {type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    self.evict_all()
                self.checkpoint()
            if "restart-direct" in names:
                try:
                    self.results["restart_direct"] = self.run_restart_direct()
                except Exception as exc:  # noqa: BLE001
                    self.results["restart_direct"] = {"error": f"{type(exc).__name__}: {exc}"}
                    self.error(f"restart-direct: {type(exc).__name__}: {exc}")
                self.checkpoint()
            if "orders" in names:
                try:
                    self.results["orders"] = self.run_orders()
                except Exception as exc:  # noqa: BLE001
                    self.results["orders"] = {"error": f"{type(exc).__name__}: {exc}"}
                    self.error(f"orders: {type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    self.evict_all()
                self.checkpoint()
            if "decoding" in names:
                self.results["decoding"] = self.run_decoding()
                if "error" in self.results["decoding"]:
                    self.error(f"decoding: {self.results['decoding']['error']}")
                self.checkpoint()
        except KeyboardInterrupt:
            self.error("interrupted")
        except Exception as exc:  # noqa: BLE001
            self.error(f"{type(exc).__name__}: {exc}")
        finally:
            self.daemon.stop()

        self.results["meta"]["loadavg_end"] = _loadavg()
        self.results["meta"]["finished"] = time.time()
        self.results["meta"]["duration_seconds"] = time.time() - started
        self.results["targets"] = _report.evaluate_targets(self.results)
        _report.write_json(self.results, self.out / "results.json")
        _report.write_markdown(self.results, self.out / "results.md")
        try:
            _report.write_png(self.results, self.out / "results.png")
        except Exception as exc:  # noqa: BLE001
            self.error(f"results.png: {exc}")
            _report.write_json(self.results, self.out / "results.json")
        self._print_summary()
        return 1 if self.results["errors"] else 0

    def _print_summary(self) -> None:
        lines = [f"overmind-lab bench{' (quick: tiny models, ratios not meaningful)' if self.quick else ''}"
                 f" — {self.results['meta']['duration_seconds']:.0f} s"]
        for t in self.results["targets"]:
            if t["value"] is None:
                continue
            if t.get("info"):  # informative: no limit
                lines.append(f"  info  {t['description']}: {t['value']:.2f} s")
                continue
            if t["id"] == "correct":
                lines.append(f"  {'pass' if t['passed'] else 'FAIL'}  {t['description']}")
            elif t.get("unit") == "x":
                lines.append(f"  {'pass' if t['passed'] else 'FAIL'}  {t['description']}: "
                             f"{t['value']:.2f}x (>= {t['limit']:g}x)")
            elif t.get("unit") == "ms":
                lines.append(f"  {'pass' if t['passed'] else 'FAIL'}  {t['description']}: "
                             f"{t['value']:.1f} ms (<= {t['limit']:g} ms)")
            elif t.get("unit") == "s":
                lines.append(f"  {'pass' if t['passed'] else 'FAIL'}  {t['description']}: "
                             f"{t['value']:.2f} s (<= {t['limit']:g} s)")
            else:
                below = "<" if t["id"] in _report.BELOW_TARGETS else "<="
                lines.append(f"  {'pass' if t['passed'] else 'FAIL'}  {t['description']}: "
                             f"{t['value']:.4f} ({below} {t['limit']:g})")
        for name in ("results.md", "results.json", "results.png"):
            lines.append(f"  {self.out / name}")
        if self.results["errors"]:
            lines.append(f"  {len(self.results['errors'])} error(s); see results.md and {self.logs}")
        print("\n".join(lines), flush=True)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark. SIGTERM and SIGHUP (a closed terminal) stop it as Ctrl-C does: the
    children and the private daemon are stopped and what was measured is written."""
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return Bench(args).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
