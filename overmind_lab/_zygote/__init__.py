"""The zygote: a per-user process that imported torch, transformers and diffusers once and forks
warm Jupyter kernels from itself.

::

    Jupyter server -- WarmProvisioner --.
                                        +--(Unix socket, SCM_RIGHTS)--> zygote (``loop``)
    kernelspec launcher (``_launcher``) -'                                 | fork
                                                     forked child (``_forked``) -> kernel

:mod:`.loop` is the zygote process (``python -m overmind_lab._zygote``, started by
``_common.zygote_client.spawn``); :mod:`.preload` what it imports and how it notices it went stale.
Identity: ``_common.zygote_paths``; wire: Note [The zygote's wire].
"""
