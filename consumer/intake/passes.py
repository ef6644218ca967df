"""Epochs that are passes: the trainer's books of which pass each shard has ended.

A producer whose source makes one pass at a time (``passes = True``, docs/resume.md
"Passes") says ``passes`` in its hello, sends ``end_pass {seq, pass}`` after the last batch
of each pass and makes no batch of the next pass before the trainer's ``next_pass``. So no
batch of pass ``k + 1`` exists before every shard ended pass ``k``, and the trainer's epoch
``k`` is exactly every shard's pass ``k``:

- ``complete()``: every shard (``shards`` of the first passing batch, or of the position
  resumed: never of a hello alone) ended the current pass;
  once every batch received has also left the intake (so all of the pass is in the queue),
  the intake calls ``advance(enqueued)``: the next pass starts, ``next_pass`` goes to every
  passing connection, and a later hello is welcomed into it;
- the queue is first in, first out and no batch of pass ``k + 1`` existed before all of pass
  ``k`` was enqueued, so the train loop trains pass ``k`` and then pass ``k + 1``: its epoch
  ``k`` ends at the step that trains the ``enqueued``-th batch (``boundaries``), and the
  producers make the next pass while the trainer trains the tail of this one.

``ends[shard]`` is the ``seq`` where each ended pass of the shard ended (its stream position,
``seq``, stays the place in the whole stream): pass ``k`` of a shard is batches
``ends[k-1]..ends[k]-1``. With ``--save`` they are kept in the input position (a resumed
trainer derives its epoch from them: ``epoch_of``).

Thread-safe: the intake thread books hellos and ends, the train loop advances.
"""

from __future__ import annotations

import logging
import threading

from stagefeed.common.position import MAX_SHARDS, InputPosition, epoch_of

log = logging.getLogger(__name__)


class PassBooks:
    """Per-shard pass ends and the trainer's epoch (see the module docstring)."""

    def __init__(self, pass_count: int, resumed: InputPosition | None = None) -> None:
        self._lock = threading.Lock()
        self.pass_count = pass_count  # passes the trainer trains (``--epochs``)
        self.shards = 0
        self.ends: dict[int, list[int]] = {}
        self.epoch = 0  # the pass the producers make now
        self.first_epoch = 0  # the epoch this process started in (a resumed one's)
        # (epoch, batches this process had enqueued when all of that pass was)
        self.boundaries: list[tuple[int, int]] = []
        if resumed is not None:
            self._resume(resumed)

    def redealt(self, resumed: InputPosition) -> None:
        """The resumed position was dealt out to another shard count (elastic resume, before
        any batch: ``ShardBooks.redeal``): start from it instead."""
        with self._lock:
            self.shards, self.ends, self.epoch, self.first_epoch = 0, {}, 0, 0
            self._resume(resumed)

    def _resume(self, resumed: InputPosition) -> None:
        if any(s.passes for s in resumed.streams.values()):
            self.shards = resumed.shards
            self.epoch = self.first_epoch = epoch_of(resumed)
            # Ends of passes not all trained are said again by the producers that redo them.
            self.ends = {k: list(s.passes[: self.epoch]) for k, s in resumed.streams.items()}

    @property
    def active(self) -> bool:
        """A passing producer has sent a batch (or the resumed position has pass ends)."""
        return self.shards > 0

    def join(self, shard: int, shards: int) -> str | None:
        """A passing hello naming ``shard`` of ``shards``: None if it may join, else why not.
        A hello settles nothing: the first batch of a passing producer does (``settle``)."""
        with self._lock:
            if not 0 < shards <= MAX_SHARDS or not 0 <= shard < shards:
                return f"shard {shard} of {shards} is not a shard"
            return self._other_count(shard, shards)

    def settle(self, shard: int, shards: int) -> str | None:
        """A batch of a passing producer of ``shard`` of ``shards``: the first one settles the
        count (unless the resumed position did); None, else why the batch is refused."""
        with self._lock:
            if self.shards == 0:
                self.shards = shards
            return self._other_count(shard, shards)

    def _other_count(self, shard: int, shards: int) -> str | None:
        if self.shards in (0, shards):
            return None
        return (f"this producer is shard {shard} of {shards}; the passing producers "
                f"before it have {self.shards} shards: an epoch could not end")  # fmt: skip

    def ended(self, shard: int, pass_: int, seq: int) -> str | None:
        """Shard ``shard`` ended pass ``pass_`` at ``seq``; why it is ignored, or None."""
        with self._lock:
            ends = self.ends.setdefault(shard, [])
            if pass_ < len(ends):  # said again (a producer that rewound, or re-said it)
                if ends[pass_] != seq:
                    return f"pass {pass_} of shard {shard} ended at {seq}, before at {ends[pass_]}"
                return None
            if pass_ != len(ends) or pass_ != self.epoch or (ends and seq < ends[-1]):
                return f"shard {shard} ended pass {pass_} at {seq} during epoch {self.epoch}"
            ends.append(seq)
            return None

    def start_of(self, shard: int, pass_: int) -> int:
        """The ``seq`` where ``shard``'s pass ``pass_`` starts (its pass before ended there)."""
        with self._lock:
            ends = self.ends.get(shard, [])
            return ends[pass_ - 1] if 0 < pass_ <= len(ends) else 0

    def complete(self) -> bool:
        """Every shard ended the current epoch's pass (and it is not the last one done)."""
        with self._lock:
            return self.shards > 0 and all(
                len(self.ends.get(s, ())) > self.epoch for s in range(self.shards)
            )

    def missing(self) -> list[int]:
        """Shards that have not ended the current pass."""
        with self._lock:
            return [s for s in range(self.shards) if len(self.ends.get(s, ())) <= self.epoch]

    def advance(self, enqueued: int) -> int:
        """All of the current pass is enqueued, ``enqueued`` batches so far: the next pass
        (returned) starts."""
        with self._lock:
            self.boundaries.append((self.epoch, enqueued))
            self.epoch += 1
            return self.epoch

    def ended_by(self, trained: int, reported: int) -> list[tuple[int, int]]:
        """``(epoch, batches)`` of the epochs past the first ``reported`` that ``trained``
        batches (of this process) complete: ``batches`` is where each ended."""
        with self._lock:
            return [b for b in self.boundaries[reported:] if b[1] <= trained]
