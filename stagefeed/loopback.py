"""How ``stagefeed run`` moves batches on its one host, decided before anything starts.

``--transport`` has one vocabulary in every command: ``zmq`` (ZeroMQ frames), ``shm``
(shared-memory slots: a sealed memfd per producer, descriptors over ZeroMQ; docs/shm.md) or
``auto``. ``run``'s default is ``auto``: its producers share the trainer's host and user, so
shared memory is used whenever its preconditions hold here, else ZeroMQ over loopback tcp:

- a sealed memfd can be made (``os.memfd_create`` with ``F_ADD_SEALS``: Linux);
- the run's socket files (the control socket and the pool socket, in the temp directory
  unless ``--bind``/``--shm-socket`` name them) fit a Unix socket path;
- every producer's pool fits in the memory free now (MemAvailable and the cgroup's headroom,
  as a producer checks its own pool), at the size the trainer will ask for.

The choice and its one-line reason go into the summary (``transport_choice``). Producers and
the trainer are then started with ``auto`` (still able to fall back, each saying why) or
``zmq``. ``--transport shm`` is not checked here: it fails at start, naming what is missing.
Imports: ``common`` and the producer's memory probe; no TensorFlow, no ZeroMQ.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import logging
import os
import tempfile

from stagefeed.common.options import MIB, UNIX_PATH_MAX, TrainerOptions
from stagefeed.common.shm.layout import (
    F_ADD_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    SlotLayout,
)
from stagefeed.common.shm.sizing import pool_slots
from stagefeed.producer.shm_lane import available_bytes

GIB = 1024 * MIB
log = logging.getLogger("stagefeed")

# ``run``'s spellings from before --transport had one vocabulary: still taken, with a line
# saying what to write instead (``undeprecate``).
DEPRECATED_TRANSPORTS = {
    "tcp": "--transport zmq (ZeroMQ over loopback tcp, as before)",
    "ipc": "--transport zmq --bind ipc://PATH (run picks a private ipc socket for now)",
}


@dataclasses.dataclass(frozen=True)
class Loopback:
    """What ``run`` hands its trainer and producers: ``transport`` (``zmq``/``shm``/``auto``),
    the address the trainer binds, and, for the summary, what was asked, chosen and why."""

    transport: str
    bind: str
    asked: str
    chosen: str
    reason: str

    def summary(self) -> dict[str, str]:
        return {"asked": self.asked, "chosen": self.chosen, "reason": self.reason}


def undeprecate(args: argparse.Namespace) -> None:
    """``run --transport tcp|ipc``: said to be deprecated, then taken as ``zmq`` (``ipc`` with a
    private ipc socket, as before, unless ``--bind`` names one)."""
    instead = DEPRECATED_TRANSPORTS.get(args.transport)
    if instead is None:
        return
    log.warning("--transport %s is deprecated: say %s", args.transport, instead)
    if args.transport == "ipc" and args.bind is None:
        args.bind = f"ipc://{ipc_path()}"
    args.transport = "zmq"


def ipc_path() -> str:
    """The run's private control socket file (the trainer removes it when it closes)."""
    return os.path.join(tempfile.gettempdir(), f"stagefeed-{os.getpid()}.sock")


def pool_socket_path() -> str:
    """The run's pool socket, in a private directory its trainer makes and removes."""
    return os.path.join(tempfile.gettempdir(), f"stagefeed-shm-{os.getpid()}", "pools.sock")


def plan(
    transport: str,
    bind: str | None,
    options: TrainerOptions,
    producers: int,
    shm_socket: str | None = None,
) -> Loopback:
    """The loopback for ``--transport`` (already one of zmq, shm, auto), ``--bind`` (None:
    ``run`` picks a private ipc socket with shared memory, else ``tcp://127.0.0.1:*``) and
    ``--shm-socket`` (None: ``pool_socket_path()``). ``options``: the run's trainer options,
    any transport (their queue, staging and credit size the pools)."""
    if transport == "auto":
        ruled_out, reason = shm_ruled_out(options, producers, bind, shm_socket)
        chosen = "zmq" if ruled_out else "shm"
        passed = "zmq" if ruled_out else "auto"
    else:
        chosen = passed = transport
        reason = f"--transport {transport}"
    if bind is None:
        bind = "tcp://127.0.0.1:*" if chosen == "zmq" else f"ipc://{ipc_path()}"
    return Loopback(passed, bind, transport, chosen, reason)


def shm_ruled_out(
    options: TrainerOptions, producers: int, bind: str | None, shm_socket: str | None = None
) -> tuple[bool, str]:
    """(True, why not) if shared memory cannot work for this run here; else (False, why it
    can: the pools' size against the memory free)."""
    problem = _memfd_problem() or _path_problem(bind, shm_socket)
    if problem:
        return True, problem
    stride = SlotLayout.of(options.schema.wire()).stride
    slots = pool_slots(
        options.queue_capacity,
        options.stage_depth,
        options.credit_per_producer,
        options.shm_producers,
    )
    need = producers * slots * stride
    room = available_bytes()
    pools = f"{producers} pool(s) of {_size(slots * stride)}"
    if room is not None and need > room:
        return True, f"{pools} would need {_size(need)}, {_size(room)} is free"
    free = "" if room is None else f" in {_size(room)} free"
    return False, f"same host; {pools} fit{free}"


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def _memfd_problem() -> str | None:
    if not hasattr(os, "memfd_create"):
        return "no memfd_create on this platform"
    try:
        fd = os.memfd_create("stagefeed-check", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        return f"memfd_create failed: {exc.strerror}"
    try:
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
    except OSError as exc:
        return f"a memfd cannot be sealed: {exc.strerror}"
    finally:
        os.close(fd)
    return None


def _path_problem(bind: str | None, shm_socket: str | None) -> str | None:
    paths = [shm_socket or pool_socket_path()]
    if bind is None:
        paths.append(ipc_path())
    for path in paths:
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            return (
                f"the socket path {path[:40]}... is {len(os.fsencode(path))} bytes, over "
                f"the {UNIX_PATH_MAX} a Unix socket takes (a shorter TMPDIR fixes it)"
            )
    return None
