"""``python -m overmind_lab._launcher.plain ARGS``: the plain kernel of a warm kernelspec (no
zygote served the launch): ``ipykernel_launcher ARGS`` run in this fresh process, which then
exits as a forked kernel does (Note [Fast exit] in ``_common/exiting``).

Note [A plain kernel's exit]: after its ``atexit`` handlers, a plain kernel that loaded a
pipeline spent ~1 s tearing down its modules and objects (measured: ``atexit`` done 270 ms
after the restart request, exit seen at 1,225 ms), and a restart waits for that exit. Nothing
of it is observable that ``exit_now`` does not keep: threads are joined, ``atexit`` runs
(IPython's clears the user namespace there, closing what it held), stdio is flushed.
"""

from __future__ import annotations

import sys

from overmind_lab._common.exiting import exit_now, run_main
from overmind_lab._common.zygote_client import KERNEL_MODULE

__all__ = ["main"]


def main() -> None:
    args = sys.argv[1:]  # ``sys.argv[0]`` becomes ipykernel_launcher's file (runpy)
    # What a `python -m ipykernel_launcher ARGS` process would have (as a forked kernel).
    sys.orig_argv = [sys.orig_argv[0], "-m", KERNEL_MODULE, *args]
    exit_now(run_main(KERNEL_MODULE))


if __name__ == "__main__":
    main()
