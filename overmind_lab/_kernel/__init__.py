"""Warm kernels: Jupyter kernels forked from a per-user zygote that has done the imports.

::

    Jupyter server -- KernelManager -- WarmProvisioner --(Unix socket, SCM_RIGHTS)--> zygote
    kernel (forked child of the zygote, own session) <-- fork, setsid, env, cwd, fds --'

- :mod:`.naming`: where a zygote lives and what makes two zygotes different (interpreter
  and the environment variables that matter to imports).
- :mod:`.preload`: what a zygote imports (the default set, the classes of cached entries,
  the third-party modules earlier kernels imported) and how it notices it went stale.
- :mod:`.zygote`: the zygote process: imports, checks, forks, reaps.
- :mod:`.child`: what a forked child does to become a kernel like a fresh one.
- :mod:`.provisioner`: the ``jupyter_client`` provisioner (``overmind-lab-warm``); any
  failure of the warm path launches a plain kernel with one log line saying why.
- :mod:`.spec`: ``overmind-lab kernel install|status|uninstall|restart-zygote``.
"""
