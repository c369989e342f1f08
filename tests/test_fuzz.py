"""Differential fuzzing: generated results are equal plain, cold, warm, and warm in a fresh
process (issue 19, item 4).

Hypothesis draws specs (``tests/fuzz_cases.py``: module trees, tokenizers, configs); each
is loaded plainly (``build(spec)``), cold (``overmind_lab.load(build, spec)``, the first
time) and warm (the same again, in this process). All three must have equal fingerprints
(``overmind_lab._common.fingerprint``) and compute the same (``fuzz_cases.forward``: a
forward pass on a fixed input, bit for bit, or the same exception type). A load may come
back uncached with a warning, and must then still equal plain (a load that draws from the
global generator inside ``fork_rng`` must: ``fuzz_cases.must_be_uncached``); no load may raise
where plain does not. Then one fresh process loads every spec warm and prints its fingerprints,
which are compared with the plain ones of this process.

The seed is fixed (``derandomize``); the run stops drawing after ``OVERMIND_FUZZ_SECONDS``
(default 120) or ``OVERMIND_FUZZ_EXAMPLES`` examples; ``make fuzz`` runs it longer. What
it found is pinned down in ``fuzz_cases.NAMED``, run by ``test_named_case``.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from torch.utils.hooks import RemovableHandle

import overmind_lab
from overmind_lab import Client
from overmind_lab._common.fingerprint import difference, fingerprint
from overmind_lab._errors import OvermindWarning
from tests import fuzz_cases

ROOT = Path(__file__).resolve().parent.parent
BUDGET = float(os.environ.get("OVERMIND_FUZZ_SECONDS", "120"))
EXAMPLES = int(os.environ.get("OVERMIND_FUZZ_EXAMPLES", "100000"))
#: How long a failure found may be shrunk, after the budget.
SHRINK_SECONDS = 120


pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`


class _OverBudget(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """Raised in the property once the budget is spent (hypothesis re-raises skips)."""


@dataclass
class Loaded:
    """One load of a spec, as the comparison needs it."""

    raised: str | None = None  # the exception's type name
    fp: dict[str, str] | None = None
    forward: str | None = None
    outcome: str | None = None  # of overmind_lab.load: cold, warm, uncached
    reason: str | None = None  # why it was uncached
    counter: int = 0  # torch's hook id counter before the load (Note [Hook ids in the fuzzer])
    warm_outcome: str | None = None  # (of a plain load) what the warm load here gave
    warm_key: str | None = None  # (of a plain load) the warm load's key
    key: str | None = None  # of overmind_lab.load
    warning: str | None = None  # overmind-lab's warning, if any


def _run(spec: str, cached: bool) -> Loaded:
    result = Loaded()
    with warnings.catch_warnings(record=True) as caught, overmind_lab.record_loads() as events:
        warnings.simplefilter("always")
        try:
            obj = overmind_lab.load(fuzz_cases.build, spec) if cached else \
                fuzz_cases.build(spec)
        except BaseException as exc:  # a panic of a Rust library (pyo3) is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            result.raised = type(exc).__name__
            obj = None
        if result.raised is None:
            result.fp = fingerprint(obj)
            result.forward = fuzz_cases.forward(obj, spec)
    if cached:
        result.outcome = events[-1].outcome if events else None
        result.reason = events[-1].reason if events else None
        result.key = events[-1].key if events else None
        ours = [str(w.message) for w in caught if issubclass(w.category, OvermindWarning)]
        result.warning = ours[0] if ours else None
    return result


def compare(spec: str, plain: Loaded, other: Loaded, label: str) -> str | None:
    """What ``other`` (a cached load) does differently from the plain load, or None."""
    if plain.raised is not None:
        if other.raised != plain.raised:
            return f"{label}: plain raises {plain.raised}, {label} " + (
                f"raises {other.raised}" if other.raised else "does not raise")
        return None
    if other.raised is not None:
        return f"{label}: raises {other.raised} where plain does not"
    if other.outcome not in ("cold", "warm", "uncached"):
        return f"{label}: outcome {other.outcome} ({other.reason})"
    refuse = fuzz_cases.must_be_uncached(spec)
    if refuse is not None and other.outcome != "uncached":
        return f"{label}: outcome {other.outcome}, where {refuse}: it must be uncached"
    assert plain.fp is not None and other.fp is not None
    found = difference(other.fp, plain.fp, names=(label, "plain"))
    if found is not None:
        return f"{label} ({other.outcome}): {found}"
    if other.forward != plain.forward:
        return f"{label} ({other.outcome}): forward {other.forward} vs plain {plain.forward}"
    return None


# Note [Hook ids in the fuzzer]: a hook's id comes from torch's process-wide counter
# (``RemovableHandle.next_id``), and the fingerprint records ids as they are: two plain
# loads one after the other differ in them. Each load of a spec therefore starts from the
# same counter, the one its plain load started from (the child is given it too), as
# verify mode does; a warm hit must then have exactly the plain load's ids.
def hook_counter() -> int:
    return int(RemovableHandle.next_id)


def set_hook_counter(value: int) -> None:
    RemovableHandle.next_id = value


def check_in_process(spec: str) -> tuple[Loaded, list[str], Loaded]:
    """Plain, cold and warm in this process: (plain, differences, warm)."""
    counter = hook_counter()
    plain = _run(spec, cached=False)
    plain.counter = counter
    after = [hook_counter()]
    set_hook_counter(counter)
    cold = _run(spec, cached=True)
    after.append(hook_counter())
    set_hook_counter(counter)
    warm = _run(spec, cached=True)
    set_hook_counter(max(hook_counter(), *after))
    plain.warm_outcome, plain.warm_key = warm.outcome, warm.key
    problems = [p for p in (compare(spec, plain, cold, "cold"),
                            compare(spec, plain, warm, "warm")) if p]
    return plain, problems, warm


#: The child: loads every spec of a JSON file warm, writes one JSON line per spec.
_CHILD = """
import json, sys, warnings
sys.path.insert(0, {root!r})
import overmind_lab
from overmind_lab._common.fingerprint import fingerprint
from tests import fuzz_cases

specs = json.load(open(sys.argv[1]))
with open(sys.argv[2], "w") as out:
    for spec, counter in specs:
        from torch.utils.hooks import RemovableHandle
        RemovableHandle.next_id = counter  # as the plain load had it
        row = {{"spec": spec, "raised": None, "fp": None, "forward": None, "outcome": None}}
        with warnings.catch_warnings(), overmind_lab.record_loads() as events:
            warnings.simplefilter("ignore")
            try:
                obj = overmind_lab.load(fuzz_cases.build, spec)
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                row["raised"] = type(exc).__name__
            else:
                row["fp"] = fingerprint(obj)
                row["forward"] = fuzz_cases.forward(obj, spec)
        row["outcome"] = events[-1].outcome if events else None
        row["key"] = events[-1].key if events else None
        out.write(json.dumps(row) + "\\n")
        out.flush()
"""


def check_fresh_process(plains: dict[str, Loaded], tmp: Path
                        ) -> tuple[list[tuple[str, str]], collections.Counter[str]]:
    """Load every spec warm in one fresh process: (spec, difference) for each that differs
    from its plain load here, and how many loads had each outcome there."""
    outcomes: collections.Counter[str] = collections.Counter()
    if not plains:
        return [], outcomes
    specs_file, out_file = tmp / "specs.json", tmp / "fresh.jsonl"
    specs_file.write_text(json.dumps([[s, p.counter] for s, p in plains.items()]))
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(ROOT)),
                           str(specs_file), str(out_file)], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["spec"] for r in rows] == list(plains)
    found = []
    for row in rows:
        fresh = Loaded(raised=row["raised"], fp=row["fp"], forward=row["forward"],
                       outcome=row["outcome"])
        plain = plains[row["spec"]]
        outcomes[fresh.outcome or "raises"] += 1
        problem = compare(row["spec"], plain, fresh, "fresh")
        # A cold load under the same key is an entry the daemon evicted (Note [Descriptor
        # budget]: thousands of entries may exceed what it may hold open), not a key that
        # differs between processes.
        evicted = fresh.outcome == "cold" and row.get("key") == plain.warm_key
        if (problem is None and plain.warm_outcome == "warm" and fresh.outcome != "warm"
                and not evicted):
            problem = f"fresh: outcome {fresh.outcome} (the key differs between processes)"
        if problem:
            found.append((row["spec"], problem))
    return found, outcomes


def _kind(spec: str) -> str:
    return str(json.loads(spec)["kind"])


def test_fuzz_plain_cold_warm_fresh(daemon: Client, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    end = start + BUDGET
    plains: dict[str, Loaded] = {}
    counts: collections.Counter[str] = collections.Counter()
    failing: dict[str, str] = {}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(spec=fuzz_cases.specs())
    def prop(spec: str) -> None:
        now = time.monotonic()
        if now > end and not failing:
            # Over budget: a skip exception ends hypothesis's run at once (returning would
            # still draw every remaining example).
            raise _OverBudget("budget spent")
        if failing and now > end + SHRINK_SECONDS:
            if spec in failing:  # shrinking takes too long: report the smallest so far
                raise AssertionError(f"spec {spec}\n" + failing[spec])
            return
        plain, problems, warm = check_in_process(spec)
        if spec not in plains:
            counts["examples"] += 1
            counts[_kind(spec)] += 1
            counts[f"warm {warm.outcome or 'raises'}"] += 1
            for shape in fuzz_cases.shapes(spec):
                counts[f"shape {shape}"] += 1
                counts[f"shape {shape}: warm {warm.outcome or 'raises'}"] += 1
            if plain.raised is not None:
                counts["plain raises"] += 1
            plains[spec] = plain
        if problems:
            failing[spec] = "\n".join(problems)
            raise AssertionError(f"spec {spec}\n" + failing[spec])

    try:
        prop()
    except _OverBudget:
        pass
    in_process = time.monotonic() - start
    fresh, fresh_outcomes = check_fresh_process(
        {s: p for s, p in plains.items() if p.raised is None}, tmp_path)
    counts.update({f"fresh {k}": v for k, v in fresh_outcomes.items()})
    total = time.monotonic() - start
    with capsys.disabled():
        print(f"\nfuzz: {counts['examples']} examples in {in_process:.0f} s (budget "
              f"{BUDGET:.0f} s, at most {EXAMPLES}), fresh process {total - in_process:.0f} s; "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "examples"))
    assert counts["examples"] > 0
    assert not fresh, "\n".join(f"spec {s}\n{p}" for s, p in fresh[:5]) + (
        f"\n... and {len(fresh) - 5} more" if len(fresh) > 5 else "")


@pytest.mark.parametrize("name", sorted(fuzz_cases.NAMED))
def test_named_case(daemon: Client, name: str) -> None:
    """A difference the fuzzer found: plain, cold and warm in this process are equal."""
    spec = fuzz_cases.NAMED[name]
    _, problems, _ = check_in_process(spec)
    assert not problems, "\n".join(problems)


def test_named_cases_fresh_process(daemon: Client, tmp_path: Path) -> None:
    """Every named case, stored here, loads warm in a fresh process equal to plain."""
    plains = {}
    for spec in fuzz_cases.NAMED.values():
        plain, _, _ = check_in_process(spec)
        if plain.raised is None:
            plains[spec] = plain
    found, _ = check_fresh_process(plains, tmp_path)
    assert not found, "\n".join(f"spec {s}\n{p}" for s, p in found)
