"""The small exception vocabulary of stagefeed.

Two ways a component stops working, kept apart as in trio:

- ``ClosedError``: *you* closed it (``close()`` was called, a stop was requested).
- ``BrokenError``: something *outside* broke it (a peer, the OS, a dead process).

``NonFiniteLoss`` stops training at a NaN or infinite loss (unless told only to warn).
``ConfigError`` is raised at start for a bad flag, option or environment value; its message
names the offending value. ``ProtocolError`` is raised for a malformed message and carries the
``DropReason`` under which the message is counted.
"""

from __future__ import annotations

import enum


class StagefeedError(Exception):
    """Base class of every error stagefeed raises on purpose."""


class ConfigError(StagefeedError, ValueError):
    """A flag, option or environment value is invalid; the message names it."""


class ClosedError(StagefeedError):
    """The component was closed by its owner; no more work will be done."""


class BrokenError(StagefeedError):
    """The component failed because of something outside it (peer, OS, child process)."""


class NonFiniteLoss(StagefeedError):
    """A train step's loss was NaN or infinite and ``on_nan`` is ``stop``: training stopped.

    The command line exits with ``EXIT_NON_FINITE`` (4) after the summary; the message names
    the step and the value.
    """

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(
            f"step {step}: loss is {loss}; training stopped (--on-nan warn only warns)"
        )
        self.step = step
        self.loss = loss


EXIT_NON_FINITE = 4
# Exit codes of ``train`` and ``run`` (docs/guarantees.md "Exit codes"): 2 a bad flag, schema,
# source or model (one line, also when a producer's source fails mid-run); 3 something broke;
# 4 a non-finite loss; 5 the data ended before the planned steps and ``--require-full-run``.
EXIT_CONFIG = 2
EXIT_BROKEN = 3
EXIT_SHORT_RUN = 5


class DropReason(enum.StrEnum):
    """Why a received message was dropped. Values are stable: they appear in summaries."""

    PARTS = "parts"  # wrong number of frames (counted while receiving, before materialising)
    MESSAGE_SIZE = "message_size"  # frames add up to more than the trainer accepts
    HEADER_SIZE = "header_size"  # header frame larger than allowed
    HEADER_NOT_MSGPACK = "header_not_msgpack"
    HEADER_NOT_MAP = "header_not_map"
    HEADER_FIELDS = "header_fields"  # missing, extra or ill-typed fields
    VERSION = "version"  # unknown protocol version
    KIND = "kind"  # a message kind this side does not take
    HELLO = "hello"  # a malformed hello (name, schema declaration)
    NO_HELLO = "no_hello"  # a batch on a connection that has not said hello
    NO_CREDIT = "no_credit"  # a batch the trainer did not ask for (flow control ignored)
    DTYPE = "dtype"  # dtype not on the allow-list (object dtypes included)
    SHAPE = "shape"  # negative, zero, too many or huge dimensions
    FRAME_SIZE = "frame_size"  # shape x itemsize differs from the frame's size
    SPEC_MISMATCH = "spec_mismatch"  # names, dtypes or shapes differ from the trainer's schema
    VALUE_RANGE = "value_range"  # a value outside an array's declared bounds
    DUPLICATE = "duplicate"  # a sequence number this connection sent before
    SEQ_RANGE = "seq_range"  # a sequence number far outside the connection's window
    PEER_LIMIT = "peer_limit"  # more connections than the trainer tracks
    INTERNAL = "internal"  # an unexpected error while handling the message (logged in full)
    SHM_DESCRIPTOR = "shm_descriptor"  # slot descriptor not a map of pool/slot/gen/seq
    SHM_POOL = "shm_pool"  # descriptor names a pool this trainer has not mapped
    SHM_SLOT = "shm_slot"  # slot index outside the pool
    SHM_GENERATION = "shm_generation"  # generation is not the slot's current one (stale)
    SHM_UNCOMMITTED = "shm_uncommitted"  # slot header not committed (torn or unfinished write)
    SHM_SEQUENCE = "shm_sequence"  # seq differs from the one committed in the slot header
    SHM_REPLAY = "shm_replay"  # this slot generation was accepted before
    SHM_SEALS = "shm_seals"  # pool fd is not a memfd sealed against shrink and grow
    SHM_POOL_SIZE = "shm_pool_size"  # pool fd size differs from the announced layout
    SHM_FD = "shm_fd"  # fd message: no fd, more than one, truncated or from a refused peer
    SHM_TOKEN = "shm_token"  # pool offered without the token of a live connection's welcome
    ALREADY_TRAINED = "already_trained"  # a shard's batch the resumed model has trained
    SHARD = "shard"  # a hello's shard does not fit the run's shards (resume)
    SHARD_TAKEN = "shard_taken"  # a hello names a shard another live connection carries
    SHARD_END = "shard_end"  # an end or end_pass of a shard its connection does not own or reach


class ProtocolError(StagefeedError):
    """A received message failed validation; it is dropped and counted under ``reason``.

    ``kind``: the message's kind when it was known before the check failed (a malformed
    ``hello`` is answered with ``refused``, so its peer learns why).
    """

    def __init__(self, reason: DropReason, detail: str, kind: str | None = None) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.kind = kind
