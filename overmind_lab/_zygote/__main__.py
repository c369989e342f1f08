"""``python -m overmind_lab._zygote --socket PATH --identity ID [--owner PID ...]``."""

import sys

from overmind_lab._zygote import preload

# Note [Installs the zygote sees] (``preload.py``): the installation as ``site`` found it, as
# early as this process can look, before the zygote's own imports.
_INSTALLED = preload.install_snapshot()

from overmind_lab._zygote.loop import main  # noqa: E402 - after the snapshot, on purpose

sys.exit(main(installed=_INSTALLED))
