"""What an observer reads of the trainer's books: frozen snapshots the ``Ledger`` hands out
(``Ledger.read()``, ``Ledger.totals()``), taken under its lock."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Totals:
    """Counters summed over every connection (``dropped`` includes drops without one)."""

    received: int = 0
    received_bytes: int = 0
    enqueued: int = 0
    trained: int = 0
    dropped: int = 0
    seq_missing: int = 0  # sequence numbers never received, the holes between connections too
    abandoned: int = 0
    queued: int = 0  # the entries' ``queued``, summed
    not_enqueued: int = 0  # the entries' ``not_enqueued``, summed


@dataclasses.dataclass(frozen=True)
class ProducerTotals:
    """What one connection delivered and had trained, and its sequence holes."""

    received: int
    trained: int
    seq_missing: int


@dataclasses.dataclass(frozen=True)
class LedgerSnapshot:
    """Every counter an observer reads, taken under one lock (so consistent with each other):
    what ``Ledger.read()`` returns. (The books are the ledger and the trainer's other
    accounting; this is one frozen reading of the ledger's part.)

    ``producers`` is keyed like ``Ledger.summary()`` (each entry's key: its label, or
    ``label#index`` when an entry open before held that label) and has no ``<unidentified>``
    entry: drops without a connection are in ``dropped`` and ``totals.dropped`` only.
    """

    totals: Totals = Totals()
    producers: Mapping[str, ProducerTotals] = dataclasses.field(default_factory=dict)
    dropped: Mapping[str, int] = dataclasses.field(default_factory=dict)  # by reason
    peer_events: Mapping[str, int] = dataclasses.field(default_factory=dict)
    refused: Mapping[str, int] = dataclasses.field(default_factory=dict)  # hellos, by reason
    ended: Mapping[str, int] = dataclasses.field(default_factory=dict)  # producers' ends, by reason
    receiving_s: float = 0.0  # from the first valid batch received (any connection) to the last

    @property
    def delivering(self) -> int:
        """Connections that delivered a valid batch (a hello alone does not count)."""
        return sum(p.received > 0 for p in self.producers.values())
