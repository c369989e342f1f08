"""``python -m benchmarks [options]`` (from the repository root): the benchmark suite."""

from benchmarks import main

if __name__ == "__main__":
    raise SystemExit(main())
