"""``stagefeed health``: exit 0 when a trainer answers a ZeroMQ handshake at an address.

Made for container healthchecks (docker/compose.yaml): it runs inside the trainer's container
with the trainer's environment, so by default it checks the address ``STAGEFEED_BIND`` names,
seen from the same host (``tcp://*:5555`` -> ``tcp://127.0.0.1:5555``).

Healthy means exactly one thing: a DEALER socket, set up like a producer's, completed the ZMTP
handshake with a ROUTER socket at the address, so a producer with these settings could deliver.
For a CURVE trainer the check needs ``--curve-keys`` (``STAGEFEED_CURVE_KEYS``, the directory
the trainer uses, which holds a producer key pair it admits); it then handshakes as a CURVE
client and the trainer's ZAP handler admits it like a producer.

Unhealthy: connection refused (not listening: still building the graph, or the trainer
ended); a failed handshake (not a ROUTER socket, a security mechanism that differs, or a key the
trainer does not list; libzmq does not always say which, so the message names all three); no
answer within ``--timeout-s``.

The check sends no message: the trainer's ledger never sees it as a producer (a connection
counter, if the trainer keeps one, does count it).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable
from typing import Any

from stagefeed import envflags
from stagefeed.common.checks import check_endpoint, check_number
from stagefeed.common.errors import ConfigError

DEFAULT_BIND = "tcp://*:5555"
_WILDCARD_TCP = re.compile(r"tcp://(\*|0\.0\.0\.0):(\d+)")


def local_endpoint(bind: str) -> str:
    """The address a process on the trainer's host connects to, for a trainer bound on ``bind``.

    ``tcp://*:P`` and ``tcp://0.0.0.0:P`` become ``tcp://127.0.0.1:P``; other addresses are
    returned unchanged. A random port (``tcp://host:*``) cannot be checked: ``ConfigError``.
    """
    check_endpoint("STAGEFEED_BIND", bind)
    if bind.startswith("tcp://") and bind.endswith(":*"):
        raise ConfigError(f"cannot health-check {bind!r}: the port is chosen at random")
    wildcard = _WILDCARD_TCP.fullmatch(bind)
    if wildcard:
        return f"tcp://127.0.0.1:{wildcard.group(2)}"
    return bind


def check(
    endpoint: str, timeout_s: float, configure: Callable[[Any], None] | None = None
) -> tuple[bool, str]:
    """Connect a DEALER socket to ``endpoint`` and watch its handshake; (healthy, why).

    ``configure(socket)`` runs before the connect (``common.curve.client_configurator``).
    """
    import zmq
    import zmq.utils.monitor

    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if configure is not None:
        configure(sock)
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout_s
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if not monitor.poll(left_ms):
                break
            message = zmq.utils.monitor.recv_monitor_message(monitor)
            verdict = _verdict(zmq, message["event"], message["value"], endpoint)
            if verdict is not None and configure is not None:
                verdict = verdict[0], verdict[1] + " (we spoke CURVE)"
            if verdict is not None:
                return verdict
        return False, f"no ZeroMQ handshake with {endpoint} within {timeout_s:g} s"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def _verdict(zmq: Any, event: int, value: int, endpoint: str) -> tuple[bool, str] | None:
    """The result a monitor event settles, or None while the handshake is still going."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return True, f"a ZeroMQ ROUTER socket answered at {endpoint}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return False, f"the peer at {endpoint} uses another security mechanism (--curve-keys?)"
        return False, f"the peer at {endpoint} failed the ZMTP handshake (error {value:#x})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return False, f"the peer at {endpoint} refused our key (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return False, (
            f"the handshake with {endpoint} failed: not a ROUTER socket, another security "
            "mechanism, or a key it does not list"
        )
    if event == zmq.EVENT_CONNECT_RETRIED:
        return False, f"nothing is listening at {endpoint} (connection refused)"
    if event == zmq.EVENT_DISCONNECTED:
        return False, f"the peer at {endpoint} hung up during the handshake (not a ROUTER socket?)"
    return None


def add_parser(subparsers: Any) -> None:
    """Register ``stagefeed health`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "health", help="exit 0 if a trainer answers at the address (container healthcheck)"
    )
    envflags.add(
        p,
        "--connect",
        default=None,
        help="address to check (default: STAGEFEED_BIND seen from this host, else "
        f"{local_endpoint(DEFAULT_BIND)})",
    )
    envflags.add(p, "--timeout-s", type=float, default=3.0, help="seconds to wait for an answer")
    envflags.add(p, "--curve-keys", default=None, help="CURVE keys directory: check as a producer")
    envflags.add(p, "--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_health)


def _health(args: argparse.Namespace) -> int:
    check_number("--timeout-s", args.timeout_s)
    endpoint = args.connect or local_endpoint(os.environ.get("STAGEFEED_BIND") or DEFAULT_BIND)
    check_endpoint("--connect", endpoint)
    configure = None
    if args.curve_keys:
        from stagefeed.common.curve import client_configurator

        configure = client_configurator(args.curve_keys)
    healthy, why = check(endpoint, args.timeout_s, configure)
    print(("healthy: " if healthy else "unhealthy: ") + why, flush=True)
    return 0 if healthy else 1
