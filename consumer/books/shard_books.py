"""The trainer's books per shard: what was trained (the input position) and what is in flight.

``ShardBooks`` is kept by the ``Ledger`` of a trainer that saves checkpoints (``--save``):
the intake asks it about every batch of a connection that named its shard in its hello
(``admit``), the train loop tells it what each step trained (``trained``), and the checkpoint
writer reads ``position()`` right after the model was saved, on the train loop's thread, so
the position holds exactly the batches whose effect is in that model.

- ``trained``: a ``StreamPosition`` per shard (``common.position``), restored from the
  checkpoint a run resumes from;
- ``in_flight``: batches accepted (received and booked) and not yet trained: queued, staged,
  in an enqueue thread's hands. A batch already trained is refused as ``already_trained``, one
  in flight as ``duplicate``: a shard's batch is trained at most once, whatever producers
  re-send (a producer that rewinds, a second connection of the same shard).
- ``welcome(shard)``: where a shard's producer starts: the first batch neither trained nor in
  flight, and the ranges above it to skip.
- the shard count is settled by the checkpoint resumed, else by the first batch admitted
  (``settle``), never by a hello (``join`` only checks a hello against it): a peer that says
  hello and leaves fixes nothing; the data's order (``common.data_order``) likewise, and a
  hello of another order is refused;
- ``redeal(shards, order)``: a resumed position whose order is the hello's, with another
  shard count, is dealt out to that count (``consumer.books.redeal``: elastic resume), as
  long as no batch was admitted since the resume;
- ``ended(shard, shards, n)`` books where a shard's stream ends, only at its reach (one past
  its last batch trained or in flight): a peer cannot end a stream it did not carry (its
  owner is checked by the intake, ``consumer.intake.claims``); ``complete()`` says whether every
  shard's stream is known to end and all of it is trained or in flight. The intake's end of
  data waits for it: a producer that ended with the batches a killed trainer lost still
  missing is moved back by its next welcome (it rewinds), and a shard whose producer is gone
  is waited for (and logged), never skipped in silence.
- ``saved(position)``: a checkpoint holding ``position`` is complete. ``saved_end(shard)`` is
  where the shard's stream ends once a complete checkpoint holds all of it (the checkpoint
  resumed from counts): the intake then tells that shard's producer ``saved``, and only then
  may the producer leave (``confirms``: the trainer writes checkpoints that say so; a
  ``ServedFeed`` whose loop calls ``saved`` itself).

Thread-safe (its own lock; the ``Ledger`` calls it under its lock, never the reverse).
"""

from __future__ import annotations

import logging
import threading

from stagefeed.common.data_order import DataOrder
from stagefeed.common.errors import ConfigError, DropReason
from stagefeed.common.position import MAX_SHARDS, InputPosition, StreamPosition
from stagefeed.consumer.books.redeal import redeal

log = logging.getLogger(__name__)


class ShardBooks:
    """Per-shard trained and in-flight batches (see the module docstring)."""

    def __init__(
        self,
        resumed: InputPosition | None = None,
        joined_only: bool = False,
        confirms: bool = False,
    ) -> None:
        self._lock = threading.Lock()
        self.resumed = resumed
        self._position = resumed or InputPosition(0)
        self.confirms = confirms
        self.saves = 0  # ``saved`` calls so far: the intake looks again when it changes
        self.finished = False  # a final checkpoint said the run is done: nothing resumes it
        self._saved_ends: dict[int, int] = {}
        if resumed is not None:
            self.saved(resumed)
        self._in_flight: dict[int, set[int]] = {}
        # Shards whose producer joined here. A cluster worker is fed only some shards (each
        # shard feeds one worker): its ``missing`` looks at those alone (``joined_only``), and
        # at the other shards of their ``produce`` commands (``expected``), which may connect
        # after their siblings ended.
        self.joined: set[int] = set()
        self.expected: set[int] = set()
        self.joined_only = joined_only
        self._admitted = False  # a batch was admitted: the shard count can no longer change

    @property
    def shards(self) -> int:
        """The shard count every hello must name (0: none seen yet, and not resumed)."""
        return self._position.shards

    def join(self, shard: int, shards: int, order: DataOrder | None = None) -> str | None:
        """A hello naming ``shard`` of ``shards`` and the data's ``order``: None if it may
        join, else why not. A hello settles nothing: the first batch does (``settle``)."""
        with self._lock:
            if not 0 < shards <= MAX_SHARDS or not 0 <= shard < shards:
                return f"shard {shard} of {shards} is not a shard"
            return self._other_count(shard, shards) or self._other_order(order)

    def redeal(self, shards: int, order: DataOrder | None) -> InputPosition | str | None:
        """A hello names ``shards`` and ``order``: when the resumed position has another shard
        count, deal it out to ``shards`` (``consumer.books.redeal``) and return the new
        position; why it cannot be (a string); None when the count is the position's."""
        with self._lock:
            old = self._position
            if self.resumed is None or old.shards in (0, shards) or not 0 < shards <= MAX_SHARDS:
                return None
            try:
                if self._admitted:
                    raise ConfigError(f"batches of its {old.shards} shards came first")
                if order is None:
                    raise ConfigError("this producer's source names no data order (a built-in "
                                      "data source or a stagefeed.MapSource does)")  # fmt: skip
                why = self._other_order(order)
                if why is not None:
                    raise ConfigError(why)
                new = redeal(old, shards)
            except ConfigError as exc:
                return (f"this producer is one of {shards} shards; the checkpoint resumed has "
                        f"{old.shards} and cannot be dealt out again: {exc}")  # fmt: skip
            self._position = self.resumed = new
            self._saved_ends = {}  # the old shards' numbers name other batches now
        log.info("the checkpoint's position of %d shards is dealt out to %d (elastic resume, "
                 "%s): every record still trained once per epoch", old.shards, shards,
                 order.describe())  # fmt: skip
        return new

    def settle(
        self, shard: int, shards: int, seekable: bool, group: range | None = None,
        order: DataOrder | None = None,
    ) -> str | None:  # fmt: skip
        """A batch of ``shard`` of ``shards`` is about to be admitted: the first one settles the
        shard count and the data's ``order`` (unless a resumed checkpoint did); None, else why
        the batch is refused. ``group``: the shards of its ``produce`` command, expected here
        from then on."""
        with self._lock:
            if self._position.shards == 0:
                self._position.shards = shards
                log.info("the run has %d shards (settled by its first batch, of shard %d)",
                         shards, shard)  # fmt: skip
            why = self._other_count(shard, shards) or self._other_order(order)
            if why is not None:
                return why
            if self._position.order is None and order is not None:
                self._position.order = order
            if not seekable and shard not in self._position.approximate:
                self._position.approximate.add(shard)
                log.warning(
                    "shard %d: its source cannot seek; its position is approximate (exact "
                    "only if the source replays the same batches)", shard,
                )  # fmt: skip
            self.joined.add(shard)
            self.expected.update(group or ())
            return None

    def _other_count(self, shard: int, shards: int) -> str | None:
        """Why ``shards`` is not the run's settled count (lock held)."""
        if self._position.shards in (0, shards):
            return None
        where = "the checkpoint resumed" if self.resumed else "the batches trained so far"
        return (
            f"this producer is shard {shard} of {shards}; {where} has "
            f"{self._position.shards} shards: the position cannot be mapped"
        )

    def _other_order(self, order: DataOrder | None) -> str | None:
        """Why a producer of ``order`` does not feed this run's position (lock held)."""
        known = self._position.order
        if known is None:
            return None
        if order is None:
            return (f"this producer's source names no data order; the run's data is "
                    f"{known.describe()}")  # fmt: skip
        return known.differs(order)

    def admit(self, shard: int, seq: int) -> DropReason | None:
        """Book batch ``seq`` of ``shard`` as in flight; the reason to drop it instead."""
        with self._lock:
            if seq in self._position.of(shard):
                return DropReason.ALREADY_TRAINED
            flying = self._in_flight.setdefault(shard, set())
            if seq in flying:
                return DropReason.DUPLICATE
            flying.add(seq)
            self._admitted = True
            return None

    def trained(self, shard: int, seq: int) -> None:
        with self._lock:
            self._in_flight.get(shard, set()).discard(seq)
            self._position.of(shard).add(seq)

    def ended(self, shard: int, shards: int, end: int) -> str | None:
        """Shard ``shard`` of ``shards`` ends at ``end`` (its owner's ``end {seq}``): None if
        booked, else why not. Only the stream's reach can be its end: every batch below it
        trained or in flight, none past it, the shard count settled and the same."""
        with self._lock:
            why = self._beyond_reach(shard, shards, end, "its stream ends")
            if why is None:
                self._position.of(shard).end = end
            return why

    def pass_ended(self, shard: int, shards: int, seq: int) -> str | None:
        """Whether a pass of ``shard`` may end at ``seq`` (as ``ended``): None, else why not."""
        with self._lock:
            return self._beyond_reach(shard, shards, seq, "a pass ends")

    def _beyond_reach(self, shard: int, shards: int, seq: int, what: str) -> str | None:
        """Lock held: why ``seq`` is not ``shard``'s reach (one past its last batch trained or
        in flight, or its start), or ``shards`` not the settled count; None if it is."""
        if self._position.shards != shards:
            settled = self._position.shards or "not settled (no batch yet)"
            return f"{what} at {seq}, but the run's shard count is {settled}, not {shards}"
        accepted = self._accepted(shard)
        reach = max(accepted.above, default=accepted.next - 1) + 1
        if seq != reach:
            return f"{what} at {seq}, but shard {shard}'s batches reach {reach}"
        return None

    def pass_ends(self, shard: int, ends: list[int]) -> None:
        """Where each ended pass of ``shard`` ended (``consumer.intake.passes``), for the
        position."""
        with self._lock:
            self._position.of(shard).passes = list(ends)

    def missing(self) -> dict[int, int]:
        """Shards not complete: their first batch neither trained nor in flight (known
        shards only, or with ``joined_only`` those that joined here and the rest of their
        ``produce`` commands; {} while none is)."""
        with self._lock:
            out = {}
            shards = (
                sorted(self.joined | self.expected) if self.joined_only
                else range(self._position.shards)
            )  # fmt: skip
            for shard in shards:
                stream = self._position.streams.get(shard, StreamPosition())
                start = self._accepted(shard).next
                if stream.end is None or start < stream.end:
                    out[shard] = start
            return out

    def saved(self, position: InputPosition, finished: bool = False) -> None:
        """A checkpoint holding ``position`` is complete (its state file is written);
        ``finished``: it is the final one of a run that is done."""
        ends = {
            shard: stream.end
            for shard, stream in position.streams.items()
            if stream.end is not None and stream.next >= stream.end
        }
        with self._lock:
            self._saved_ends.update(ends)
            self.finished = self.finished or finished
            self.saves += 1

    def saved_end(self, shard: int) -> int | None:
        """Where ``shard``'s stream ends, if a complete checkpoint holds all of it; else None."""
        with self._lock:
            return self._saved_ends.get(shard)

    def lost(self, shard: int, seq: int) -> None:
        """Batch ``seq`` left the feed untrained (abandoned): it may come again."""
        with self._lock:
            self._in_flight.get(shard, set()).discard(seq)

    def welcome(self, shard: int) -> tuple[int, list[list[int]]]:
        """``(start, skip)`` for a producer of ``shard`` (trained or in flight is skipped)."""
        with self._lock:
            accepted = self._accepted(shard)
            return accepted.next, accepted.ranges()

    def _accepted(self, shard: int) -> StreamPosition:
        """Trained or in flight (lock held); adds no stream to the position."""
        stream = self._position.streams.get(shard, StreamPosition())
        accepted = StreamPosition(stream.next, set(stream.above))
        for seq in self._in_flight.get(shard, ()):
            accepted.add(seq)
        return accepted

    def position(self) -> InputPosition:
        """A copy of what was trained, for the checkpoint's state file."""
        with self._lock:
            out = InputPosition(self._position.shards, approximate=set(self._position.approximate),
                                order=self._position.order)  # fmt: skip
            for shard, stream in self._position.streams.items():
                out.streams[shard] = StreamPosition(
                    stream.next, set(stream.above), stream.end, list(stream.passes)
                )
            return out
