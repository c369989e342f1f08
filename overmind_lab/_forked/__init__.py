"""A forked child of the zygote, from the fork until it is a kernel like a fresh one."""
