"""One message off the trainer's ROUTER, frame by frame, keeping only what the limits allow;
and one control message back (``reply``).

libzmq's ``maxmsgsize`` bounds a single frame, not a message, so the intake reads with
``RCVMORE`` and keeps at most ``max_frames`` frames and ``max_bytes`` bytes: the rest is
received and let go at once (drained, never kept), and the message is refused by reason.
Memory held per message is therefore bounded whatever a peer sends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import zmq

from stagefeed.common import protocol
from stagefeed.common.errors import DropReason, ProtocolError


@dataclasses.dataclass
class Received:
    """A message as read: who sent it, the frames kept, and what arrived in all."""

    routing_id: bytes
    frames: list[zmq.Frame]
    count: int  # frames after the routing id, kept or not
    total: int  # their bytes

    def check(self, max_frames: int, max_bytes: int) -> None:
        """ProtocolError by reason if the message passed a limit or has no header."""
        if self.count > max_frames:
            raise ProtocolError(DropReason.PARTS, f"{self.count} frames > {max_frames}")
        if self.total > max_bytes:
            raise ProtocolError(DropReason.MESSAGE_SIZE, f"{self.total} B > {max_bytes} B")
        if not self.frames:
            raise ProtocolError(DropReason.PARTS, "no header frame")


def receive_message(router: zmq.Socket, max_frames: int, max_bytes: int) -> Received:
    """Read one whole message (the caller knows one is ready); see the module docstring."""
    first = router.recv(copy=False)
    frames: list[zmq.Frame] = []
    count, total, more = 0, 0, first.more
    while more:
        frame = router.recv(copy=False)
        more = frame.more
        count += 1
        total += len(frame)
        if count <= max_frames and total <= max_bytes:
            frames.append(frame)
    return Received(first.bytes, frames, count, total)


def reply(router: zmq.Socket, routing_id: bytes, kind: str, **fields: Any) -> None:
    """Send one control message to ``routing_id``. ROUTER drops a message to a peer that is
    gone or full: a reply can never block."""
    try:
        router.send_multipart([routing_id, protocol.encode_control(kind, **fields)],
                              flags=zmq.NOBLOCK)  # fmt: skip
    except zmq.Again:
        pass
