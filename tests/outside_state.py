"""Module-level state of the user's code (``tests/`` is no installed distribution's), which a
result may refer to: what ``test_faithful`` refuses to cache and ``test_fingerprint_outside``
names (Note [What pickling cannot carry], Note [Sharing with the outside])."""

from __future__ import annotations

import numpy
import torch

REGISTRY: dict[str, int] = {"hits": 0}
HISTORY: list[int] = []
SIZES = (1, 2)  # immutable: a copy cannot be told from it
ARRAY = numpy.arange(4.0)


class Settings:
    """A user class: its instances are mutable state."""

    def __init__(self) -> None:
        self.level = 1


SETTINGS = Settings()
SHARED_LAYER = torch.nn.utils.skip_init(torch.nn.Linear, 2, 2)
