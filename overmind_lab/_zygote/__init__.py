"""The zygote: a per-user process that imported the heavy libraries once and forks warm
Jupyter kernels from itself (``python -m overmind_lab._zygote``; wire: Note [The zygote's wire])."""
