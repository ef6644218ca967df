"""Ctrl-C in a user's program that waits for data: the feed's queue is closed so the wait ends.

CPython runs a Python-level signal handler (``KeyboardInterrupt`` for SIGINT) only once the
main thread is back in the interpreter; a ``for batch in feed.dataset()`` loop or a ``fit``
blocked in the dataset's dequeue sits in TensorFlow's C++ until a batch comes, which may be
never (no producer, or producers that failed). ``SigintWake`` hands the signal to a thread
instead: made in the main thread, while SIGINT has Python's default handler and no wakeup fd is
set (``signal.set_wakeup_fd``: CPython writes each signal's number there, from C, at once),
it sets one and runs the thread ``stagefeed-feed-signals`` reading it. On SIGINT that thread
logs one line and calls ``on_sigint`` (``ServedFeed``: close the queue), the blocked dequeue
returns, and the user's ``KeyboardInterrupt`` is raised. Not inside TensorFlow's own Python
code, though: the first bytecode after the dequeue is TensorFlow's building of the error its
C++ raised, and a ``KeyboardInterrupt`` there turns into pybind11's ``RuntimeError``
("MISMATCH of original and normalized active exception types", measured with TF 2.21). So
while the feed lives, SIGINT's Python handler is ``_on_sigint``: it raises
``KeyboardInterrupt`` unless the main thread is in a frame of TensorFlow's package, in which
case the thread tries again (``_thread.interrupt_main``) every ``RETRY_S`` until it is out,
and ``close()`` (the ``with`` block's end) raises it if it is still owed. Keras' package is
treated as TensorFlow's: its training code holds bare ``except:`` clauses
(``keras/src/trainers/compile_utils.py``, ``keras/src/backend/tensorflow/core.py``, run while
a step function is traced), which would swallow a ``KeyboardInterrupt`` raised there; deferred,
it is raised after the step by ``FeedCallback`` (``raise_owed``) or in the user's own code.
SIGTERM keeps its default (the library installs no handler: SIGTERM ends the user's
process). A program with its own SIGINT handler or wakeup fd (the CLI, asyncio) is left
alone.

Lifecycle: ``start()`` -> ``close()`` (idempotent: the thread is joined; in the main thread
the wakeup fd is set back to none and SIGINT to Python's default handler; from another thread
they cannot be, so the pair of sockets stays open, unread, as CPython's target, and that is
logged).
"""

from __future__ import annotations

import _thread
import importlib.util
import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType

import tensorflow as tf

from stagefeed.common.lifecycle import join_threads

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 3.0
RETRY_S = 0.005  # one switch interval of the GIL: a retry costs the main thread little


def _package_dirs() -> tuple[str, ...]:
    """TensorFlow's folder and Keras' (found without importing it: a custom loop's feed does
    not load Keras)."""
    dirs = [os.path.dirname(tf.__file__) + os.sep]
    keras = importlib.util.find_spec("keras")
    if keras is not None and keras.submodule_search_locations:
        dirs += [os.path.join(d, "") for d in keras.submodule_search_locations]
    return tuple(dirs)


_DEFER_IN = _package_dirs()  # a frame of these packages: the interrupt waits (module docstring)
_STOP = b"\0"  # no signal has number 0: the byte that stops the thread


class SigintWake:
    """The wakeup fd and its thread (see the module docstring)."""

    def __init__(self, on_sigint: Callable[[], None]) -> None:
        self._close_feed = on_sigint
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._retry = threading.Event()  # the handler ran inside TensorFlow: signal again
        self._deferred = False  # a KeyboardInterrupt is owed to the main thread

    def start(self) -> bool:
        """Install the wakeup fd and start the thread; False (nothing done) if not in the
        main thread, if SIGINT has a handler other than Python's default, or if a wakeup fd
        is set already."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        old = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if old != -1:  # someone else's: theirs again
            signal.set_wakeup_fd(old)
            reader.close()
            writer.close()
            return False
        self._pair = (reader, writer)
        signal.signal(signal.SIGINT, self._on_sigint)
        self._thread = threading.Thread(
            target=self._read, args=(reader,), name="stagefeed-feed-signals", daemon=True
        )
        self._thread.start()
        return True

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """SIGINT's Python handler while the feed lives (main thread): ``KeyboardInterrupt``,
        unless in TensorFlow's or Keras' code (see the module docstring)."""
        if frame is not None and frame.f_code.co_filename.startswith(_DEFER_IN):
            self._deferred = True
            self._retry.set()
            return
        self._deferred = False
        raise KeyboardInterrupt

    def raise_owed(self) -> None:
        """(the main thread, outside TensorFlow's and Keras' code: ``FeedCallback`` after each step)
        Raise the ``KeyboardInterrupt`` the handler deferred, if any: a ``fit`` whose steps
        keep the main thread in TensorFlow's code would otherwise train its whole queued tail
        before the retries catch it outside (seen in the matrix: 89 batches after Ctrl-C)."""
        if self._deferred:
            self._deferred = False
            raise KeyboardInterrupt

    def _read(self, reader: socket.socket) -> None:
        closed = False  # SIGINT came: from now on, look for a handler that deferred
        retried = 0.0
        while True:
            ready, _, _ = select.select([reader], [], [], RETRY_S if closed else None)
            if ready:
                try:
                    got = reader.recv(64)
                except BlockingIOError:
                    got = b"-"  # nothing after all
                if not got or _STOP in got:
                    return
                if signal.SIGINT in got and not closed:
                    closed = True
                    log.info("SIGINT: the feed's queue closes so a wait for data ends "
                             "(KeyboardInterrupt follows in the main thread)")  # fmt: skip
                    self._close_feed()
            now = time.monotonic()
            if self._retry.is_set() and now - retried >= RETRY_S:
                self._retry.clear()
                retried = now
                _thread.interrupt_main(signal.SIGINT)

    def close(self) -> None:
        """Idempotent: stop and join the thread; the wakeup fd back to none (main thread)."""
        if self._pair is None:
            return
        reader, writer = self._pair
        self._pair = None
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            signal.set_wakeup_fd(-1)
            if signal.getsignal(signal.SIGINT) == self._on_sigint:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            writer.send(_STOP)
        except OSError as exc:  # full of unread signal bytes: the thread is busy reading
            log.debug("stopping stagefeed-feed-signals: %s", exc)
        if self._thread is not None:
            join_threads([self._thread], JOIN_TIMEOUT_S)
        if in_main:
            reader.close()
            writer.close()
            if self._deferred:  # never out of TensorFlow's or Keras' code: raised here
                self._deferred = False
                raise KeyboardInterrupt
        else:
            log.info("the feed closed outside the main thread: its SIGINT wakeup fd stays set "
                     "until the process ends")  # fmt: skip
