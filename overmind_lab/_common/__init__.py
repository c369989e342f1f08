"""Shared by several processes (wires, names, sizes); imports no torch, daemon or client."""
