"""The daemon process: one per user, never imports torch or unpickles anything."""
