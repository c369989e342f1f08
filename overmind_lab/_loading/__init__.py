"""The kernel side: talking to the daemon and the load path.

``client`` (the daemon connection), ``load`` (``load()``, hits and misses), ``keys``, ``pickling``,
``segments`` and ``refresh_worker`` (the process that replays a load).
"""
