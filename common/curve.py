"""CURVE authentication: the key layout ``stagefeed keygen`` writes and the socket set-up.

Layout of a keys directory (``stagefeed keygen DIR --clients N``)::

    DIR/server.key                     the trainer's public key
    DIR/server.key_secret              the trainer's key pair (trainer only)
    DIR/authorized_clients/NAME.key    public keys the trainer admits (trainer only)
    DIR/client.key, client.key_secret  the "local" producer pair (producers on the trainer's host)
    DIR/client-I/client.key            producer I's public key
    DIR/client-I/client.key_secret     producer I's key pair
    DIR/client-I/server.key            the trainer's public key

``--curve-keys DIR`` on ``train`` needs ``server.key_secret`` and ``authorized_clients/``; on
``produce`` it needs ``client.key_secret`` and ``server.key``. DIR itself has both, so one flag
serves ``stagefeed run`` and a trainer and producers on one host; copy ``DIR/client-I`` (no
trainer secret in it) to a producer on another host.

The trainer's socket is a CURVE server and a ZAP handler (``ThreadAuthenticator``) admits only
clients whose public key is in ``authorized_clients/`` (read once, at start). Plain-text peers
fail the handshake (mechanism mismatch); unknown keys fail it with ZAP status 400. Either way
no message of theirs reaches the socket. ZeroMQ's ipc transport is protected by file
permissions, not by CURVE.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85

from stagefeed.common.errors import ConfigError
from stagefeed.common.lifecycle import join_threads

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

SERVER_PUBLIC = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_PUBLIC = "client.key"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED = "authorized_clients"
AUTH_THREAD_NAME = "stagefeed-curve-auth"
STOP_TIMEOUT_S = 3.0
MIN_RCVHWM = 2


def key_fingerprint(public_key: str | bytes) -> str:
    """``key 3fa9c2e1``: how books, logs and ``keygen`` name a producer's CURVE public key (z85
    text, as ZAP gives it): the first 8 hex digits of its SHA-256. A slice of the z85 text
    would read as line noise (``Ltpb.N$}``) and could hold ``#`` or spaces."""
    text = public_key.decode("ascii") if isinstance(public_key, bytes) else public_key
    try:
        raw = z85.decode(text) if len(text) == 40 else text.encode("utf-8", "replace")
    except ValueError:
        raw = text.encode("utf-8", "replace")
    return "key " + hashlib.sha256(raw).hexdigest()[:8]


def load_key_pair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``.key_secret`` file; ``ConfigError`` naming the file."""
    public, secret = _load(path)
    if secret is None:
        raise ConfigError(f"{path} holds no secret key (a .key_secret file is needed)")
    return public, secret


def load_public_key(path: str) -> bytes:
    """The z85 public key in ``path``; ``ConfigError`` naming the file if it is unusable."""
    return _load(path)[0]


def authorized_keys(keys_dir: str) -> dict[bytes, bool]:
    """The allow-list in ``keys_dir/authorized_clients``; it must exist and hold a key."""
    folder = os.path.join(keys_dir, AUTHORIZED)
    if not os.path.isdir(folder):
        raise ConfigError(f"curve keys: {folder} is missing (written by stagefeed keygen)")
    import zmq.auth  # here, not at the top: CURVE's imports (asyncio) cost every process 60 ms

    keys = zmq.auth.load_certificates(folder)
    if not keys:
        raise ConfigError(f"curve keys: no public key (*.key) in {folder}; nobody could connect")
    return keys


class ServerCurve:
    """Configures the trainer's bound socket as a CURVE server and owns its ZAP authenticator.

    Lifecycle: construction loads and checks the keys (``ConfigError`` at start, nothing
    running); ``__call__(socket)`` starts the authenticator on the socket's context and makes
    the socket a CURVE server, and must run before the socket binds (an unauthenticated peer
    could otherwise slip in before the ZAP handler exists); ``close()`` stops the authenticator
    thread (idempotent) and must run before the context is terminated, since the ZAP socket
    belongs to that context.

    The socket's receive high-water mark is raised to ``MIN_RCVHWM`` (see ``__call__``): with
    CURVE on, up to two messages per producer may wait in ZeroMQ instead of one.
    """

    def __init__(self, keys_dir: str) -> None:
        self.keys_dir = keys_dir
        self.public, self.secret = load_key_pair(os.path.join(keys_dir, SERVER_SECRET))
        self.allowed = len(authorized_keys(keys_dir))
        self._auth: ThreadAuthenticator | None = None
        self._lock = threading.Lock()

    def __call__(self, socket: zmq.Socket) -> None:
        with self._lock:
            if self._auth is None:
                from zmq.auth.thread import ThreadAuthenticator

                auth = ThreadAuthenticator(socket.context, log=log)
                auth.start()
                auth.thread.name = AUTH_THREAD_NAME
                auth.configure_curve(domain="*", location=os.path.join(self.keys_dir, AUTHORIZED))
                self._auth = auth
            elif self._auth.context is not socket.context:
                raise ConfigError("a ServerCurve serves the sockets of one zmq.Context only")
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True
        # libzmq 4.3.5 delivers nothing through a CURVE+ZAP connection whose receive HWM is 1
        # (poll reports a message, recv says EAGAIN, forever; tested in tests/test_curve.py):
        # 2 is the smallest value that works, so one more message per producer may wait.
        socket.rcvhwm = max(socket.rcvhwm, MIN_RCVHWM)
        log.info("CURVE on: admitting %d client keys from %s", self.allowed, self.keys_dir)

    @property
    def running(self) -> bool:
        return self._auth is not None and self._auth.is_alive()

    def close(self) -> list[str]:
        """Stop the authenticator; return the names of threads that did not stop in time."""
        with self._lock:
            auth, self._auth = self._auth, None
        if auth is None:
            return []
        # ThreadAuthenticator.stop() joins without a timeout, and a second TERMINATE on a pipe
        # whose peer is gone would block: end the thread and join it here, with a timeout,
        # then close the pipe ourselves and let stop() close only the ZAP socket.
        thread = auth.thread
        auth.pipe.send(b"TERMINATE")
        stuck = join_threads([thread], STOP_TIMEOUT_S)
        if not stuck:
            auth.pipe.close(linger=0)
            auth.pipe = None  # type: ignore[assignment]
            auth.thread = None  # type: ignore[assignment]
            auth.stop()
        return stuck


def server_configurator(keys_dir: str) -> ServerCurve:
    """The trainer's socket configurator for ``--curve-keys keys_dir`` (see ``ServerCurve``)."""
    return ServerCurve(keys_dir)


def client_configurator(keys_dir: str) -> Callable[[zmq.Socket], None]:
    """A function making a producer's socket a CURVE client of the trainer in ``keys_dir``.

    Keys are read here, so a bad directory fails before any socket exists.
    """
    public, secret = load_key_pair(os.path.join(keys_dir, CLIENT_SECRET))
    server_public = load_public_key(os.path.join(keys_dir, SERVER_PUBLIC))

    def configure(socket: zmq.Socket) -> None:
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_serverkey = server_public

    return configure


def _load(path: str) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise ConfigError(f"curve keys: {path} is missing (written by stagefeed keygen)")
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"curve keys: {path} is not a ZeroMQ certificate: {exc}") from None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise ConfigError(f"curve keys: {path} does not hold 40-character z85 keys")
    return public, secret
