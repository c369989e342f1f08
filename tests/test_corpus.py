"""The warm-equivalence corpus (``tests/corpus.py``), in verify mode: every case loaded
cold, warm in the same process and warm in a fresh process equals a plain load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from overmind_lab import Client
from tests import corpus

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

ROOT = Path(__file__).resolve().parent.parent
#: Cases whose load draws random numbers: never cached, still equal to a plain load.
SEEDED = {"seeded new head", "seeded mismatched sizes"}


def _phase(models: Path, phase: str) -> dict[str, dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "tests.corpus", str(models), phase],
                          cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


def test_every_case_warm_equals_a_plain_load(daemon: Client, tmp_path: Path) -> None:
    corpus.build(tmp_path)
    first = _phase(tmp_path, "first")
    assert len(first) >= 25, sorted(first)
    again = _phase(tmp_path, "again")
    assert set(again) == set(first)
    problems = []
    for name in first:
        expect_first = ["uncached"] * 2 if name in SEEDED else ["cold", "warm"]
        expect_again = ["uncached"] if name in SEEDED else ["warm"]
        for phase, rows, expected in (("first", first, expect_first),
                                      ("again", again, expect_again)):
            row = rows[name]
            if row["difference"] or row["mismatches"] or row["outcomes"] != expected:
                problems.append(f"{phase} {name}: outcomes {row['outcomes']} (want "
                                f"{expected}), difference {row['difference']!r}, "
                                f"verify {row['mismatches']}")
    assert not problems, "\n".join(problems)
    verified = sum(e.get("verified", 0) for e in Client().entries())
    assert verified >= 2 * (len(first) - len(SEEDED) - 1)  # two warm hits each, verified

