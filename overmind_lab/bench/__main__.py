"""``python -m overmind_lab.bench [options]``: the benchmark without the CLI."""

from __future__ import annotations

import argparse

from overmind_lab.bench import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overmind_lab.bench",
                                     description="overmind-lab benchmark (same as `overmind-lab bench`)")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
