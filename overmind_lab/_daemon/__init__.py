"""The daemon process: one per user, never imports torch or unpickles anything.

``server`` (accept loop and the operation table), ``leases`` (single flight), ``index``
(entries, LRU, budget), ``holders`` (who maps what), ``store`` and ``persist`` (segments
and the index on disk), ``refresh`` (background reloads), ``process`` (lock, bind,
detach).
"""
