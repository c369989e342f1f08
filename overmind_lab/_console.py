"""The ``overmind-lab`` command (and ``python -m overmind_lab``): ``run`` goes to
``_launcher/run.py`` before anything else is imported (Note [A plain run at once]); every other
command to ``cli``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["run"]:
        from overmind_lab._launcher import run

        return run.main(words[1:])
    from overmind_lab.cli import main as cli_main

    return cli_main(words)
