"""A forked child of the zygote, from the fork until it is a kernel like a fresh one (``become``).
The zygote hands over a ``ForkTask`` at the fork; nothing here imports the zygote's code
(Note [Leaving the zygote's loop])."""
