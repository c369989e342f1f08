"""What the kernel side and the daemon side share: the wire, names, sizes.

Nothing here imports torch, the daemon or the client.
"""
