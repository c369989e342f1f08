"""``python -m overmind_lab._zygote --socket PATH --identity ID [--owner PID ...]``."""

import sys

from overmind_lab._zygote.loop import main

sys.exit(main())
