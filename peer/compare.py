"""Compare the plain and the warm run of `make peer-test` test by test.

Usage: compare.py PLAIN.xml WARM.xml [STATS.json]. Prints a table per test file (one per
model) and every test whose outcome differs; exits 1 if any does, if a run has no test or
no warm hit, or if verify mode found a difference.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def outcomes(path: str) -> dict[str, str]:
    """test id -> passed, failed, skipped or xfailed (errors count as failed)."""
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        result[test_id] = outcome
    return result


def main() -> int:
    plain, warm = outcomes(sys.argv[1]), outcomes(sys.argv[2])
    stats = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else {}
    files = stats.get("files", {})
    ids = sorted(set(plain) | set(warm))
    diffs = [(i, plain.get(i, "missing"), warm.get(i, "missing")) for i in ids
             if plain.get(i) != warm.get(i)]
    by_model: dict[str, list[str]] = {}
    for i in ids:
        by_model.setdefault(i.split(".")[0], []).append(i)
    head = (f"{'model file':<18}{'tests':>6}  {'plain p/f/s/xf':>16}  {'warm p/f/s/xf':>16}"
            f"  {'diffs':>5}  {'hits/calls':>11}  {'mismatch':>8}")
    print(head)
    print("-" * len(head))
    for model, tests in sorted(by_model.items()):
        p = Counter(plain.get(i, "missing") for i in tests)
        w = Counter(warm.get(i, "missing") for i in tests)
        n_diff = sum(1 for i in tests if plain.get(i) != warm.get(i))
        s = files.get(model + ".py", {})
        cells = [f"{c['passed']}/{c['failed']}/{c['skipped']}/{c['xfailed']}" for c in (p, w)]
        hits = f"{s.get('hits', 0)}/{s.get('calls', 0)}"
        print(f"{model:<18}{len(tests):>6}  {cells[0]:>16}  {cells[1]:>16}  {n_diff:>5}"
              f"  {hits:>11}  {s.get('mismatches', 0):>8}")
    total = stats.get("total", {})
    print(f"total: {len(ids)} tests, {len(diffs)} differences, "
          f"{total.get('hits', 0)} warm hits of {total.get('calls', 0)} doubled calls, "
          f"{total.get('mismatches', 0)} VerifyMismatch warnings")
    for test_id, a, b in diffs:
        print(f"DIFFERS  {test_id}: plain {a}, warm {b}")
    # A run that collected nothing, or whose calls never hit warm, proves nothing.
    if not plain or not warm:
        print("FAILED: a run has no test (see the pytest output above)")
        return 1
    if stats and not total.get("hits"):
        print("FAILED: no from_pretrained call was served warm")
        return 1
    if total.get("mismatches"):
        print("FAILED: verify mode found warm hits that differ from a plain load")
        return 1
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
