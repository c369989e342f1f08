"""The daemon's operation table against the wire's list of operations."""

from __future__ import annotations

from overmind_lab._common.messages import OPS
from overmind_lab._daemon.server import OPERATIONS


def test_every_operation_of_the_wire_has_a_handler_and_no_other() -> None:
    assert sorted(OPERATIONS) == sorted(OPS)


def test_only_stop_ends_the_connection() -> None:
    assert [op for op, operation in OPERATIONS.items() if operation.last] == ["stop"]
