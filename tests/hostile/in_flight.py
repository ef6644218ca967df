"""An in-process intake closed while a batch is in flight (``python -m tests.hostile
stop-in-flight``, run in a child process by the hostile-input tests)."""

from __future__ import annotations

import threading
import time

import zmq

from stagefeed.common import protocol
from stagefeed.common.schema import Schema
from tests.hostile.peers import Peer
from tests.hostile.wire import valid_arrays

WAIT_S = 10.0


def stop_with_batch_in_flight() -> int:
    """``python -m tests.hostile stop-in-flight``: an in-process intake whose enqueue returns
    only once ``close()`` has stopped the intake thread (as a FIFOQueue enqueue cancelled at
    shutdown does, late). Prints how long ``close()`` took; exits 0 if the process survived
    it and the intake thread ended.
    """
    from stagefeed.common.options import TrainerOptions
    from stagefeed.common.schema import ArraySpec
    from stagefeed.consumer.books.ledger import Ledger
    from stagefeed.consumer.intake.intake import Intake

    schema = Schema((ArraySpec("x", "float32", (3,)),), 2)
    entered = threading.Event()
    waited: list[bool] = []

    def enqueue(arrays, index, seq) -> bool:
        entered.set()
        # Returns once the intake thread, which close() stops, has ended: its sockets closed.
        (serving,) = [t for t in threading.enumerate() if t.name == "stagefeed-intake"]
        serving.join(WAIT_S)
        waited.append(not serving.is_alive())
        return False  # "closed for shutdown"

    options = TrainerOptions(bind="tcp://127.0.0.1:*", schema=schema, queue_mb=1)
    intake = Intake(options, schema, enqueue, Ledger()).start()
    ctx = zmq.Context()
    peer = Peer(ctx, intake.endpoint, timeout_s=10)
    peer.hello("in-flight")
    peer.send_batch(protocol.encode_batch(0, valid_arrays(schema)))
    if not entered.wait(WAIT_S):
        return 2
    began = time.monotonic()
    intake.close()
    print(f"closed in {time.monotonic() - began:.2f} s", flush=True)
    peer.close()
    ctx.term()
    if waited != [True]:
        print(f"the intake thread did not end within {WAIT_S} s of close()", flush=True)
        return 1
    return 0
