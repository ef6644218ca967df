"""The producer's side of the v2 conversation with one trainer, across its connections.

``Session`` holds the protocol state the channel thread acts on and decides what every
message from the trainer means; it never touches a socket (``producer.link`` does the I/O and
asks it what to send). Used by the channel thread only.

Per connection (libzmq reconnects by itself; each connection is a new peer to the trainer):
``handshake()`` makes a hello due; after ``hello_sent`` only pings go until a welcome; then a
batch only against credit (``welcome.credit``, then ``credit {n}``), one each. Credit is 0
again on ``disconnected()``, a ``bye``, or a ``refused`` / ``dropped`` of reason
``no_hello``, which also makes a hello due on the same connection.

Every hello carries the session's secret ``session`` token (32 hex digits, drawn once): the
trainer links the books of this run's connections by it, never by the name.

Shared memory: a session made with ``shm=True`` says so in every hello; each welcome's
``shm_*`` fields (or their absence) land in ``shm_offer`` and ``welcomes`` counts welcomes, so
the channel thread attaches a new pool per welcome (``producer.shm_lane``). A ``release``
message goes to ``on_release``.

The schema is fixed by the first welcome: the declared one, or the trainer's adopted. Every
later hello declares it, so a trainer that comes back with another schema refuses us
(``SchemaMismatch``) instead of dropping every batch.

Errors: ``SchemaMismatch`` / ``ConfigError`` for a refusal that waiting cannot fix (exit 2),
``BrokenError`` for an unusable welcome (exit 3). Malformed messages and verdicts are logged at
most once per reason every few seconds (``common.throttle``) and otherwise ignored.
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from stagefeed.common import protocol
from stagefeed.common.errors import BrokenError, ConfigError, DropReason, ProtocolError
from stagefeed.common.excerpt import excerpt
from stagefeed.common.schema import Schema, SchemaMismatch
from stagefeed.common.throttle import LogThrottle
from stagefeed.producer.handoff import (
    Credit,
    Dropped,
    EndRead,
    Lost,
    NextPass,
    Repositioned,
    Saved,
    Welcome,
    Welcomed,
)
from stagefeed.producer.shm_lane import ShmOffer

log = logging.getLogger(__name__)

UNREACHABLE_LOG_S = 2.0
NO_WELCOME_LOG_S = 10.0
HELLO_RETRY_S = 5.0  # after a refused hello the trainer may accept later (peer_limit)
# After ``shard_taken``: another live connection carries our shard. It may be our own run's
# before a kill -9 whose connection the trainer has not yet seen close: hello again soon.
SHARD_RETRY_S = 1.0
MAX_CREDIT = 2**20
_REASONS = frozenset(r.value for r in DropReason)


class Session:
    """Conversation state; ``post`` sends ``Welcomed``, ``Credit``, ``Dropped`` and ``Lost``
    events to the owner."""

    def __init__(
        self,
        endpoint: str,
        name: str,
        schema: Schema | None,
        max_unsent_of: Callable[[Schema], int],
        post: Callable[[object], None],
        *,
        shm: bool = False,
        on_release: Callable[[str, int, int], object] | None = None,
        hello_fields: Mapping[str, Any] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._hello_fields = dict(hello_fields or {})  # the shard's (protocol: hello)
        self.shm = shm
        self.shm_offer: ShmOffer | None = None  # of the latest welcome
        self.welcomes = 0  # welcomes accepted, on any connection
        # A later welcome moved this shard (``Repositioned``): nothing more of this stream
        # goes on this channel; its owner rewinds onto a new one.
        self.moved = False
        self._on_release = on_release
        self.name = name
        # Links this run's connections in the trainer's books; secret, so that no other peer
        # claiming our name can write into them (consumer/books/ledger.py).
        self._token = secrets.token_hex(16)
        self.schema = schema  # declared, or adopted from the first welcome; then fixed
        self.welcome: Welcome | None = None  # the first one
        self._max_unsent_of = max_unsent_of
        self._post = post
        self._notices = LogThrottle()
        self._drops: collections.Counter[str] = collections.Counter()
        self._unreachable_since = time.monotonic()
        self._said_unreachable = False
        self._credit = 0
        self.lost = 0  # connections to the trainer lost so far
        self.trainer_pass = 0  # the pass the trainer is in (a hello that said ``passes``)
        self._reset(connected=False)

    @property
    def credit(self) -> int:
        """Batches the trainer will take now; every change is posted (``Credit``)."""
        return self._credit

    @credit.setter
    def credit(self, n: int) -> None:
        if n != self._credit:
            self._credit = n
            self._post(Credit(n))

    def _reset(self, connected: bool) -> None:
        self.connected = connected
        self.hello_due = connected
        self.hello_not_before = 0.0
        self.welcomed = False
        self.credit = 0
        self._hello_at: float | None = None
        self._bye = False
        self._said_no_welcome = False
        # ``leaving`` to send: this connection's trainer let us go (``saved``, a finished run)
        self.leaving_due = False

    # -- connection events ---------------------------------------------------------------------

    def handshake(self) -> None:
        """A new connection completed its ZMTP handshake: a new peer, a hello is due."""
        if self._said_unreachable:
            log.info("trainer at %s reachable again", self.endpoint)
        self._said_unreachable = False
        self._reset(connected=True)

    def disconnected(self, now: float) -> None:
        """The connection closed (the trainer went away, or was silent past the heartbeat
        timeout): credit is 0; a lost connection is logged with the endpoint and posted."""
        was_connected = self.connected
        self._reset(connected=False)
        if was_connected:
            self.lost += 1
            log.warning(
                "lost the trainer at %s (connection closed, or silent past the heartbeat "
                "timeout); reconnecting",
                self.endpoint,
            )
            self._unreachable_since = now
            self._post(Lost())

    def hello(self) -> dict[str, Any]:
        """Fields of the hello to send now: the same ``session`` token on every connection."""
        declared = self.schema.to_dict() if self.schema is not None else None
        shm = {"shm": True} if self.shm else {}
        return {"name": self.name, "schema": declared, "session": self._token, **shm,
                "ack_end": True, **self._hello_fields}  # fmt: skip

    def hello_sent(self, now: float) -> None:
        self.hello_due = False
        self._hello_at = now

    def spend_credit(self) -> None:
        assert self.welcomed and self.credit > 0
        self.credit -= 1

    # -- messages from the trainer -------------------------------------------------------------

    def handle(self, frames: list[bytes], now: float) -> Welcome | None:
        """Act on one message; return the ``Welcome`` if it was the first one."""
        if len(frames) != 1:
            self.notice("parts", f"a {len(frames)}-frame message from {self.endpoint} ignored")
            return None
        try:
            header = protocol.decode_header(frames[0], protocol.FROM_TRAINER)
        except ProtocolError as exc:
            self.notice(exc.reason.value, f"malformed message from {self.endpoint}: {exc}")
            return None
        kind = header["t"]
        if kind == "welcome":
            return self._on_welcome(header)
        if kind == "refused":
            self._on_refused(header, now)
        elif kind == "credit":
            if self.welcomed:
                self.credit = min(self.credit + header["n"], MAX_CREDIT)
        elif kind == "dropped":
            self._on_dropped(header)
        elif kind == "release":
            if self._on_release is not None:
                self._on_release(header["pool"], header["slot"], header["gen"])
        elif kind == "next_pass":  # credit is 0 again, grants follow (protocol)
            if self.welcomed:
                self.credit = 0
            self._pass_is(header["pass"])
        elif kind == "saved":
            if self._confirming:
                self._post(Saved(header["seq"]))
                self.leaving_due = True  # the trainer may be closing: it waits for this
        elif kind == "ended":
            self._post(EndRead(header["seq"]))
        elif kind == "bye":
            self.credit = 0
            self._post(EndRead(None))  # a trainer closing reads no ``end`` any more
            if header.get("finished") is True and self._confirming:
                log.info("trainer at %s finished its run: no trainer will resume it, so "
                         "nothing is waited for", self.endpoint)  # fmt: skip
                self._post(Saved(None))
                self.leaving_due = True
                self._bye = True  # not "waiting for it to come back": nothing will
            if not self._bye:
                self._bye = True
                log.info("trainer at %s is closing; waiting for it to come back", self.endpoint)
        return None

    @property
    def _confirming(self) -> bool:
        """The first welcome said ``confirm``: ``saved`` and a finished ``bye`` mean something."""
        return self.welcome is not None and self.welcome.confirm

    def _on_welcome(self, header: dict[str, Any]) -> Welcome | None:
        if self._hello_at is None or self.welcomed:
            log.debug("unexpected welcome from %s ignored", self.endpoint)
            return None
        try:
            schema = Schema.from_dict(header["schema"], source=f"welcome from {self.endpoint}")
        except ConfigError as exc:
            raise BrokenError(str(exc)) from None
        if self.schema is not None and schema.wire() != self.schema.wire():
            raise SchemaMismatch(
                f"trainer at {self.endpoint} now expects {schema.describe()}; this producer "
                f"sends {self.schema.describe()}"
            )
        agreed = self.schema or schema
        try:
            resume = protocol.resume_of_welcome(header)
            passes = protocol.passes_of_welcome(header)
        except ProtocolError as exc:
            raise BrokenError(f"welcome from {self.endpoint}: {exc}") from None
        size = message_bytes(agreed)
        if size > header["max_message"]:
            raise ConfigError(
                f"trainer at {self.endpoint} accepts messages of at most {header['max_message']} "
                f"B; one batch of {agreed.describe()} is {size} B with its header"
            )
        self.welcomed = True
        self.credit = header["credit"]
        self.welcomes += 1
        self.shm_offer = (
            ShmOffer(header["shm_socket"], header["shm_token"], header["shm_slots"])
            if "shm_socket" in header
            else None
        )
        if self.welcome is not None:
            log.info("trainer at %s welcomed us again (credit %d)", self.endpoint, self.credit)
            if passes is not None:
                self._pass_is(passes[0])
            if resume is not None:
                self.moved = True
                self._post(Repositioned(resume))
            elif header.get("confirm") is not True:
                self._post(Saved(None))  # this trainer will not confirm: nothing to wait for
            return None
        self.schema = agreed
        max_unsent = self._max_unsent_of(agreed)
        self.welcome = Welcome(
            agreed, header["max_message"], header["credit"], max_unsent, resume, passes,
            confirm=header.get("confirm") is True,
        )  # fmt: skip
        self.trainer_pass = passes[0] if passes is not None else 0
        self._post(Welcomed(self.welcome))
        return self.welcome

    def _pass_is(self, pass_: int) -> None:
        if pass_ > self.trainer_pass:
            self.trainer_pass = pass_
            self._post(NextPass(pass_))

    def _on_refused(self, header: dict[str, Any], now: float) -> None:
        reason = header["reason"]
        detail = protocol.one_line(header["detail"])
        if reason == DropReason.NO_HELLO:
            self.notice(reason, f"trainer at {self.endpoint} does not know us: hello again")
            self._reset(connected=self.connected)
        elif reason == DropReason.PEER_LIMIT:
            self.notice(reason, f"trainer at {self.endpoint} is full ({detail}); retrying")
            self._reset(connected=self.connected)
            self.hello_not_before = now + HELLO_RETRY_S
        elif reason == DropReason.SHARD_TAKEN:
            self.notice(reason, f"trainer at {self.endpoint} refused our shard ({detail}); "
                                f"saying hello again every {SHARD_RETRY_S:.0f} s")  # fmt: skip
            self._reset(connected=self.connected)
            self.hello_not_before = now + SHARD_RETRY_S
        elif reason == DropReason.SPEC_MISMATCH:
            raise SchemaMismatch(f"trainer at {self.endpoint}: {detail}")
        else:
            raise ConfigError(
                f"trainer at {self.endpoint} refused this producer ({excerpt(reason)}): {detail}"
            )

    def _on_dropped(self, header: dict[str, Any]) -> None:
        reason = header["reason"] if header["reason"] in _REASONS else "other"
        self._drops[reason] += 1
        self._post(Dropped(header["seq"], reason))
        self.notice(
            f"dropped:{reason}",
            f"trainer at {self.endpoint} dropped batch {header['seq']}: {reason}: "
            f"{protocol.one_line(header['detail'])} ({self._drops[reason]} so far)",
        )
        if reason == DropReason.NO_HELLO and self.welcomed:
            self._reset(connected=self.connected)

    # -- logging -------------------------------------------------------------------------------

    def log_waiting(self, now: float) -> None:
        """Say once that the trainer is unreachable, or silent after our hello."""
        if (
            not self.connected
            and not self._said_unreachable
            and now - self._unreachable_since > UNREACHABLE_LOG_S
        ):
            self._said_unreachable = True
            log.warning("cannot reach the trainer at %s; retrying quietly", self.endpoint)
        if (
            self._hello_at is not None
            and not self.welcomed
            and not self._said_no_welcome
            and now - self._hello_at > NO_WELCOME_LOG_S
        ):
            self._said_no_welcome = True
            log.warning(
                "no welcome from %s %.0f s after hello: is it a stagefeed trainer (protocol v%d)?",
                self.endpoint,
                NO_WELCOME_LOG_S,
                protocol.PROTOCOL_VERSION,
            )

    def notice(self, key: str, message: str) -> None:
        """Log ``message`` unless a line of the same ``key`` went out in the last 5 s."""
        if self._notices.due(key):
            log.warning("%s", message)


def message_bytes(schema: Schema) -> int:
    """Bytes of a ``batch`` message of ``schema``, header included (its largest seq's)."""
    arrays = [[name, dtype.str, list(shape)] for name, dtype, shape in schema.wire()]
    header = {"v": protocol.PROTOCOL_VERSION, "t": "batch", "seq": 2**63 - 1, "arrays": arrays}
    return len(msgpack.packb(header)) + schema.batch_bytes
