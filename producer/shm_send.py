"""One batch through a shared-memory slot: the producer's main loop when a pool is attached.

``send_in_slot`` takes a free slot of the pool the trainer accepted, has the source write the
batch into it (a filling source writes in place, no copy; an iterable source's batch is copied
in once), commits it and hands the descriptor to the channel against credit. The slot comes
back when the trainer's ``release`` arrives, i.e. once TensorFlow dropped the last tensor
using it; until then nothing writes into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stagefeed.common.errors import BrokenError, ConfigError
from stagefeed.producer.sources import BatchStream, SourceFailed

if TYPE_CHECKING:
    from stagefeed.producer.channel_contract import Channel

SENT = "sent"  # batch ``seq`` was handed over
LOST = "lost"  # its pool was retired while it was written (that trainer is gone): seq is free
END = "end"  # the source's data ended
NOT_SHARED = "zmq"  # the channel runs over ZeroMQ now (``auto`` fell back): send it that way


def send_in_slot(channel: Channel, stream: BatchStream, seq: int, stop: Any) -> str:
    """Batch ``seq`` through a slot; one of ``SENT``, ``LOST``, ``END``, ``NOT_SHARED``.
    ``SourceFailed`` if the source failed (the slot is given back)."""
    got = channel.acquire_slot(stop)
    if got is None:
        return NOT_SHARED
    pool, slot = got
    try:
        more = stream.fill_into(pool.arrays(slot))
    except (ConfigError, BrokenError) as exc:
        channel.discard_slot(pool, slot)
        raise SourceFailed(exc) from exc
    except BaseException:
        channel.discard_slot(pool, slot)
        raise
    if not more:
        channel.discard_slot(pool, slot)
        return END
    desc = channel.commit_slot(pool, slot, seq)
    if desc is None:
        return LOST
    channel.send_descriptor(desc, seq, stop)
    return SENT
