"""The zygote: a per-user process that imported torch, transformers and diffusers once and
forks warm Jupyter kernels from itself.

::

    Jupyter server -- WarmProvisioner --.
                                        +--(Unix socket, SCM_RIGHTS)--> zygote (``loop``)
    kernelspec launcher (``_launcher``) -'                                 | fork
                                                     forked child (``_forked``) -> kernel

- :mod:`.loop`: the zygote process: imports, checks, forks, reaps, owners, replacement;
  ``python -m overmind_lab._zygote`` runs it (started by ``_common.zygote_client.spawn``).
- :mod:`.preload`: what a zygote imports (the default set, the classes of cached entries,
  the learned modules: ``_common.learned``) and how it notices it went stale.

Where a zygote lives and what makes two different: ``_common.zygote_paths``. Its wire:
Note [The zygote's wire] in ``_common.messages``.
"""
