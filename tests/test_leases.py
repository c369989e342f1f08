"""Single flight in-process (``_daemon.leases``): who loads, who waits, and the takeover
when a holder's connection ends. Plain objects on a real asyncio loop; no daemon."""

from __future__ import annotations

import asyncio

from overmind_lab._daemon.leases import Leases


class Conn:
    """Stands for a daemon connection: leases only compare owners by identity."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_the_first_asker_holds_the_lease_and_the_others_get_it_to_wait_for() -> None:
    leases = Leases()
    a, b = Conn("a"), Conn("b")
    assert leases.acquire("k", a) is None  # a loads it
    busy = leases.acquire("k", b)
    assert busy is not None and busy.owner is a
    assert leases.acquire("k", a) is busy  # a second lookup by the holder waits too
    assert leases.holds(a, "k") and not leases.holds(b, "k")
    assert leases.held_by(a) == ["k"] and leases.held_by(b) == []
    assert leases.acquire("other", b) is None  # another key: no waiting


def test_a_waiter_wakes_when_the_lease_is_released_and_times_out_before() -> None:
    async def scenario() -> list[bool]:
        leases = Leases()
        a, b = Conn("a"), Conn("b")
        leases.acquire("k", a)
        busy = leases.acquire("k", b)
        assert busy is not None
        early = await busy.released(0.01)
        waiting = asyncio.ensure_future(busy.released(60.0))
        await asyncio.sleep(0)
        leases.release("k")
        return [early, await waiting, leases.holds(a, "k")]

    assert asyncio.run(scenario()) == [False, True, False]


def test_the_clean_up_runs_before_the_waiters_wake() -> None:
    events: list[str] = []

    async def scenario() -> None:
        leases = Leases(on_release=lambda key: events.append(f"clean up {key}"))
        a, b = Conn("a"), Conn("b")
        leases.acquire("k", a)
        busy = leases.acquire("k", b)
        assert busy is not None

        async def wait() -> None:
            await busy.released(60.0)
            events.append("woke")

        waiter = asyncio.ensure_future(wait())
        await asyncio.sleep(0)
        leases.release("k")
        await waiter
        leases.release("never leased")  # a reservation without a lease is cleaned too

    asyncio.run(scenario())
    assert events == ["clean up k", "woke", "clean up never leased"]


def test_when_the_holder_goes_one_waiter_takes_over_and_the_others_wait_for_it() -> None:
    """The daemon's lookup loop (Note [Single flight and takeover]): a waiter wakes, looks
    again, and takes the lease if nobody stored the key."""

    loading: set[str] = set()
    overlaps: list[set[str]] = []

    async def scenario() -> list[str]:
        leases = Leases()
        holder = Conn("holder")
        leases.acquire("k", holder)
        loaded: list[str] = []

        async def lookup(conn: Conn) -> None:
            while True:
                busy = leases.acquire("k", conn)
                if busy is None:  # it loads the key, fails, and its connection ends
                    loaded.append(conn.name)
                    loading.add(conn.name)
                    if len(loading) > 1:
                        overlaps.append(set(loading))
                    await asyncio.sleep(0.01)
                    loading.discard(conn.name)
                    leases.release_all(conn)
                    return
                await busy.released(60.0)

        waiters = [asyncio.ensure_future(lookup(Conn(f"w{i}"))) for i in range(3)]
        await asyncio.sleep(0.01)
        assert loaded == []  # all three wait while the holder loads
        leases.release_all(holder)  # the holder's connection ended without a store
        await asyncio.gather(*waiters)
        return loaded

    # each took over in turn when the one before it let go, never two loads at once
    assert sorted(asyncio.run(scenario())) == ["w0", "w1", "w2"]
    assert overlaps == []


def test_release_all_lets_go_of_the_owners_keys_only() -> None:
    cleaned: list[str] = []
    leases = Leases(on_release=cleaned.append)
    a, b = Conn("a"), Conn("b")
    leases.acquire("x", a)
    leases.acquire("y", a)
    leases.acquire("z", b)
    leases.release_all(a)
    assert sorted(cleaned) == ["x", "y"]
    assert leases.held_by(a) == [] and leases.held_by(b) == ["z"]
    assert leases.acquire("x", b) is None
