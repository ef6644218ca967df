"""Credit flow control: a fixed pool, a per-connection cap, round-robin grants, expiry."""

from __future__ import annotations

import time
from collections.abc import Callable

from stagefeed.consumer.intake.connections import Connection, Connections

# A time-out no test machine stalls through: for "not yet" checks, which must not depend on
# the machine not pausing for a few milliseconds.
NEVER_S = 3600.0
LEASE_S = 0.05  # a time-out that passes within a test
WAIT_S = 10.0


def _invariant(conns: Connections) -> None:
    held = sum(c.outstanding + c.in_hand for c in conns.live())
    assert conns.available + held + sum(conns._orphaned.values()) == conns.pool


def _until_some(forget: Callable[[], list[Connection]], what: str) -> list[Connection]:
    """Call ``forget`` (``expire`` or ``revoke_hoarded``) until it forgets a connection, for
    at most ``WAIT_S``: its time-out has to pass first, and only then may it act."""
    deadline = time.monotonic() + WAIT_S
    while not (gone := forget()) and time.monotonic() < deadline:
        time.sleep(LEASE_S / 5)
    assert gone, f"waited {WAIT_S} s for {what} (time-out {LEASE_S} s)"
    return gone


def test_grants_never_exceed_the_pool_or_the_per_connection_cap():
    conns = Connections(pool=4, per_peer=3, max_live=8, timeout_s=10)
    a = conns.add(b"a", 0, "a")
    assert dict((c.name, n) for c, n in conns.grants()) == {"a": 3}
    b = conns.add(b"b", 1, "b")
    assert dict((c.name, n) for c, n in conns.grants()) == {"b": 1}
    _invariant(conns)
    assert conns.use_credit(a) and conns.use_credit(a)
    conns.finished(b"a")
    granted = dict((c.name, n) for c, n in conns.grants())
    assert granted == {"b": 1}  # the free credit goes to the connection below its cap
    _invariant(conns)
    assert (a.outstanding + a.in_hand, b.outstanding + b.in_hand) == (2, 2)


def test_a_batch_without_credit_is_refused():
    conns = Connections(pool=1, per_peer=1, max_live=8, timeout_s=10)
    a = conns.add(b"a", 0, "a")
    assert not conns.use_credit(a)
    conns.grants()
    assert conns.use_credit(a) and not conns.use_credit(a)


def test_expired_connections_return_their_credit_even_with_batches_in_hand():
    patient = Connections(pool=4, per_peer=4, max_live=8, timeout_s=NEVER_S)
    patient.add(b"a", 0, "a")
    assert patient.expire() == []  # silent, but not for its time-out yet
    conns = Connections(pool=4, per_peer=4, max_live=8, timeout_s=LEASE_S)
    a = conns.add(b"a", 0, "a")
    conns.grants()
    assert conns.use_credit(a)  # one in hand, three outstanding
    assert [c.name for c in _until_some(conns.expire, "the silent connection to expire")] == ["a"]
    assert conns.available == 3
    conns.finished(b"a")  # the batch in hand finishes after the connection is gone
    assert conns.available == 4
    _invariant(conns)


def test_an_ended_producer_gets_no_more_credit():
    conns = Connections(pool=4, per_peer=2, max_live=8, timeout_s=10)
    a = conns.add(b"a", 0, "a")
    conns.grants()
    conns.end(a)
    assert conns.available == 4 and conns.grants() == []


def _hoarding(timeout_s: float) -> tuple[Connections, Connection]:
    """A hoarder holding the whole pool unused while another connection starves."""
    conns = Connections(pool=2, per_peer=2, max_live=8, timeout_s=timeout_s)
    hoarder = conns.add(b"h", 0, "h")
    conns.grants()
    conns.add(b"g", 1, "g")
    assert conns.grants() == []  # the hoarder holds the whole pool
    return conns, hoarder


def test_credit_unused_while_another_starves_is_revoked():
    patient, _ = _hoarding(NEVER_S)
    assert patient.revoke_hoarded() == []  # not unused for long enough yet
    conns, hoarder = _hoarding(LEASE_S)
    revoked = _until_some(conns.revoke_hoarded, "the hoarded credit to be revoked")
    assert [c.name for c in revoked] == ["h"]
    assert conns.get(b"h") is None and hoarder.outstanding == 0
    assert dict((c.name, n) for c, n in conns.grants()) == {"g": 2}
    _invariant(conns)
