"""Hostile and malformed input (wire protocol v2) against one real trainer that keeps training.

One ``stagefeed train`` process (package fixture, ``conftest.py``) trains on a good producer's
batches while each test sends its messages over its own DEALER connection
(``tests.hostile.peers.Peer``, which says hello first unless the case is about not saying it),
or a raw TCP socket speaking ZMTP. Batches that get past the header are sent against credit,
as the protocol says, so they reach the check they bend, and the peer must get a ``dropped``
verdict naming the reason.

The trainer's live counters are read from its Prometheus endpoint, so every case checks exactly
what it caused: the drop counters by reason move by the expected amounts and nothing else
moves. Every test then checks that the good producer's trained count grew after its cases,
with no gap in its books, and that the trainer's RSS, now and at its peak during the test
(``VmHWM``, reset before the test), stays within the byte budget. The trainer steps about once
a second on two CPU cores, so the variants of one kind of input are the cases of one test.
The last test stops the trainer and checks the JSON summary books every case.

The byte budget is the trainer's bound on bytes held (``TrainerOptions.held_bytes_bound``)
plus what malloc may keep of freed batch buffers, computed from the trainer's threads
(``procs.allocator_allowance_mib``). What one message may cost (``per_message_mib`` in
``test_sizes_and_floods.py``): ``--max-message-mb`` plus libzmq's ``zmq_msg_t`` (64 B) for each
frame, which libzmq holds until a multipart message's last frame has arrived, before the
trainer can see it and drop it. Where that lands in RSS depends on the allocator's history, so
the message of 200k frames checks what the trainer holds after it (the heap in use).

The shared target, its checks and the helpers are in ``harness.py``; the fixtures, and the
order that runs the summary last (``RUN_LAST``), in ``conftest.py``. The tests, by concept:
``test_framing_and_headers.py``, ``test_arrays.py``, ``test_credit_and_sequence.py``,
``test_hello_and_schema.py``, ``test_sizes_and_floods.py`` and ``test_summary.py``.
"""
