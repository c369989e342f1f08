"""The daemon process: one per user, never imports torch or unpickles anything.

``server`` (accept loop and operations), ``index`` (entries, LRU, budget), ``holders``
(who maps what), ``refresh`` (background reloads), ``process`` (lock, bind, detach).
"""
