"""``python -m overmind_lab``: the command line (same as ``overmind-lab``)."""

from overmind_lab._console import main

raise SystemExit(main())
