"""The peers ``bench ingest`` compares against: raw pyzmq between processes, and memcpy.

Raw pyzmq is the transport's ceiling for stagefeed's own messages (a protocol v2 ``batch``
header and one frame per array, same transport): sender processes push one prebuilt message
zero-copy in a loop to one PULL socket (receive high-water mark 1, I/O threads as the
trainer's), the receiver takes it zero-copy and drops it. No flow control and no replies: the
ceiling. No TensorFlow here: this module is imported by the spawned sender processes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import tempfile
import time
from typing import Any

import numpy as np
import zmq

from stagefeed.bench.batches import host_batch
from stagefeed.common import protocol
from stagefeed.common.errors import BrokenError
from stagefeed.common.lifecycle import stop_processes
from stagefeed.common.logs import setup_logging
from stagefeed.common.schema import Schema

log = logging.getLogger(__name__)

POLL_MS = 100
RECV_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 5.0
SENDER_HWM = 2  # as many unsent messages as bench ingest's producers may hold


def endpoint_for(transport: str, tag: str) -> tuple[str, str | None]:
    """(bind address, ipc path or None) on loopback; ``shm``'s control channel is ipc."""
    if transport in ("ipc", "shm"):
        path = os.path.join(tempfile.gettempdir(), f"stagefeed-bench-{tag}-{os.getpid()}")
        return f"ipc://{path}", path
    return "tcp://127.0.0.1:*", None


def sender_main(endpoint: str, schema: Schema, index: int, stop: Any, log_level: int) -> None:
    """A raw sender process: one message built once, sent zero-copy until ``stop``.

    The batch header's ``seq`` is the sender's index (the v2 batch header names no producer),
    so the receiver can tell when every sender has been heard from.
    """
    setup_logging(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns shutdown
    batch = host_batch(schema, seed=index)
    frames = protocol.encode_batch(index, [(name, batch[name]) for name in schema.names])
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, SENDER_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    parent = os.getppid()
    try:
        while not stop.is_set() and os.getppid() == parent:
            if sock.poll(POLL_MS, zmq.POLLOUT):
                sock.send_multipart(frames, copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()


def measure_raw(
    schema: Schema, senders: int, transport: str, count: int, log_level: int = logging.WARNING
) -> dict[str, Any]:
    """GB/s (1e9 B) of ``count`` messages, timed once every sender has been heard from.

    Warm-up: until each sender's first message arrived, then ``2 x senders`` more.
    """
    ctx = zmq.Context(io_threads=min(4, senders))  # as the receive pool's context
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.LINGER, 0)
    address, ipc_path = endpoint_for(transport, "raw")
    sock.bind(address)
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    mp = multiprocessing.get_context("spawn")
    stop = mp.Event()
    procs: list[Any] = []
    try:
        for i in range(senders):
            proc = mp.Process(
                target=sender_main,
                args=(endpoint, schema, i, stop, log_level),
                name=f"bench-raw-sender-{i}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        seen: set[int] = set()
        warmup = 0
        while len(seen) < senders:
            header = _recv(sock, procs)[0]
            seen.add(protocol.decode_header(header, protocol.FROM_PRODUCER)["seq"])
            warmup += 1
        for _ in range(2 * senders):
            _recv(sock, procs)
            warmup += 1
        received = 0
        cpu_before = _cpu_s(procs)
        started = time.perf_counter()
        for _ in range(count):
            frames = _recv(sock, procs)
            received += sum(memoryview(f).nbytes for f in frames[1:])
        elapsed = time.perf_counter() - started
        cpu_after = _cpu_s(procs)
    finally:
        stop.set()
        sock.close(linger=0)
        stop_processes(procs, STOP_TIMEOUT_S)
        ctx.term()
        if ipc_path and os.path.exists(ipc_path):
            os.unlink(ipc_path)
    return {
        "messages": count,
        "warmup_messages": warmup,
        "bytes": received,
        "seconds": round(elapsed, 4),
        "gb_per_s": round(received / elapsed / 1e9, 3),
        "core_ms_per_batch": _per_batch_ms(cpu_before, cpu_after, count),
    }


def _cpu_s(procs: list) -> float | None:
    """CPU seconds of the senders and of this (receiving) process; None without psutil."""
    try:
        from stagefeed.bench.cpu import process_cpu_s, sum_cpu_s
    except ImportError:
        return None
    return sum_cpu_s([process_cpu_s(), *(process_cpu_s(p.pid) for p in procs)])


def _per_batch_ms(before: float | None, after: float | None, count: int) -> float | None:
    if before is None or after is None or not count:
        return None
    return round((after - before) * 1000 / count, 3)


def _recv(sock: zmq.Socket, procs: list) -> list:
    deadline = time.monotonic() + RECV_TIMEOUT_S
    while not sock.poll(POLL_MS):
        dead = [p.name for p in procs if not p.is_alive()]
        if dead:
            raise BrokenError(f"raw sender processes ended: {', '.join(dead)}")
        if time.monotonic() > deadline:
            raise BrokenError(f"no raw message within {RECV_TIMEOUT_S:.0f} s")
    return sock.recv_multipart(copy=False)


def measure_memcpy(schema: Schema, repeats: int) -> dict[str, Any]:
    """Single-core ``np.copyto`` of one batch's images into a preallocated array."""
    images = schema["images"]
    source = np.empty(schema.batch_shape(images), dtype=images.np_dtype)
    source.fill(1)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the target's pages in before timing
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - started)
    best, median = min(times), sorted(times)[len(times) // 2]
    return {
        "bytes": source.nbytes,
        "repeats": repeats,
        "median_ms": round(median * 1000, 3),
        "gb_per_s": round(source.nbytes / median / 1e9, 3),
        "best_gb_per_s": round(source.nbytes / best / 1e9, 3),
    }
