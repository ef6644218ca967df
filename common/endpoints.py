"""ZeroMQ endpoints parsed and checked at start: ``tcp://HOST:PORT``, ``ipc://PATH``, ``inproc://NAME``.

libzmq's own parsing is loose: ``tcp://127.0.0.1:99999`` binds port 34463 (the port wraps
modulo 65536) and ``tcp://host:0`` connects to nothing, silently. So every endpoint an option
names is parsed here first, and a bad one fails before anything starts, with a ``ConfigError``
naming the field and the value.

An address to *bind* may use wildcards: ``*`` as the host (every interface), ``*`` or ``0`` as
the port (one the OS picks), ``ipc://*`` (a socket file libzmq names). An address to *connect*
to may not.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re

from stagefeed.common.errors import ConfigError

TRANSPORTS = ("tcp", "ipc", "inproc")
MAX_PORT = 65535
# A unix socket address holds 108 bytes on Linux, the terminating NUL included.
MAX_IPC_PATH_BYTES = 107
MAX_DNS_NAME = 253
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_DOTTED_NUMBERS = re.compile(r"[0-9.]+")
FORMS = "tcp://HOST:PORT, ipc://PATH or inproc://NAME"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One parsed endpoint; ``str()`` gives it back in libzmq's syntax.

    - tcp: ``host`` is ``*``, an IPv4 or IPv6 address (without brackets) or a DNS name;
      ``port`` is 1..65535, or 0 for a port the OS picks (written ``*``);
    - ipc: ``path`` is the socket file, ``@name`` in Linux's abstract namespace, or ``*``;
    - inproc: ``path`` is the name.
    """

    transport: str
    host: str | None = None
    port: int | None = None
    path: str | None = None

    def __post_init__(self) -> None:
        why = _problem(self.transport, self.host, self.port, self.path, bind=True)
        if why:
            raise ConfigError(f"endpoint {why}, got {self!r}")

    def __str__(self) -> str:
        if self.transport == "tcp":
            host = f"[{self.host}]" if self.ipv6 else self.host
            return f"tcp://{host}:{self.port or '*'}"
        return f"{self.transport}://{self.path}"

    @property
    def ipv6(self) -> bool:
        """True for a tcp endpoint on an IPv6 address (libzmq then needs ``zmq.IPV6`` set)."""
        return self.transport == "tcp" and ":" in (self.host or "")

    @property
    def random(self) -> bool:
        """The OS (tcp port 0) or libzmq (``ipc://*``) picks the address when it is bound."""
        return (self.transport == "tcp" and self.port == 0) or (
            self.transport == "ipc" and self.path == "*"
        )


def _problem(
    transport: object, host: object, port: object, path: object, *, bind: bool
) -> str | None:
    """What is wrong with these fields as an address to bind (or to connect to), if anything."""
    if transport not in TRANSPORTS:
        return f"transport must be one of {', '.join(TRANSPORTS)}"
    if transport == "tcp":
        if path is not None:
            return "a tcp endpoint has no path"
        why = host_problem(host, wildcard_ok=bind)
        if why:
            return why
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= MAX_PORT:
            return f"port {port!r} is not in 1..{MAX_PORT}"
        if port == 0 and not bind:
            return f"port must be in 1..{MAX_PORT} (0 and * only pick a port to bind)"
        return None
    if host is not None or port is not None:
        return f"an {transport} endpoint has a path, not a host and port"
    if not isinstance(path, str) or not path or any(c.isspace() or c == "\0" for c in path):
        return f"{transport} needs a name without spaces"
    if transport == "ipc":
        if path == "*" and not bind:
            return "ipc://* only names a random socket file to bind"
        size = len(os.fsencode(path))
        if size > MAX_IPC_PATH_BYTES:
            return (
                f"the ipc path is {size} bytes; a unix socket path holds at most "
                f"{MAX_IPC_PATH_BYTES}"
            )
    return None


def host_problem(host: object, *, wildcard_ok: bool) -> str | None:
    """Why ``host`` is not ``*`` (when allowed), an IPv4/IPv6 address or a DNS name; or None."""
    if not isinstance(host, str) or not host:
        return "the host is missing"
    if host == "*":
        return None if wildcard_ok else "host * only names every interface to bind"
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"host {host!r} is not an IPv6 address"
        return None
    if _DOTTED_NUMBERS.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"host {host!r} is not an IPv4 address"
        return None
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if len(name) > MAX_DNS_NAME or not all(_LABEL.fullmatch(label) for label in labels):
        return f"host {host!r} is not an IP address or a DNS name"
    return None


def parse(field: str, value: object, *, bind: bool = False) -> Endpoint:
    """``value`` as an ``Endpoint``; ``ConfigError`` naming ``field`` and ``value`` if it is not
    one. ``bind``: an address to bind, where wildcards are allowed (see the module docstring)."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{field} {value!r}: {why}")

    if not isinstance(value, str):
        raise bad(f"expected a string like {FORMS}")
    transport, sep, rest = value.partition("://")
    if not sep or transport not in TRANSPORTS:
        raise bad(f"expected {FORMS}")
    host: str | None = None
    port: int | None = None
    path: str | None = None
    if transport == "tcp":
        if rest.startswith("["):
            end = rest.find("]")
            if end < 0 or rest[end + 1 : end + 2] != ":":
                raise bad("expected tcp://[IPv6]:PORT")
            host, port_text = rest[1:end], rest[end + 2 :]
            if ":" not in host:
                raise bad(f"[{host}] is not an IPv6 address")
        else:
            host, colon, port_text = rest.rpartition(":")
            if not colon:
                raise bad("the port is missing: expected tcp://HOST:PORT")
            if ":" in host:
                raise bad("an IPv6 address goes in brackets: tcp://[::1]:PORT")
        if port_text == "*":
            port = 0
        elif port_text.isascii() and port_text.isdigit() and len(port_text) <= 5:
            port = int(port_text)
        else:
            raise bad(f"port {port_text!r} is not a number in 1..{MAX_PORT}")
    else:
        path = rest
    why = _problem(transport, host, port, path, bind=bind)
    if why:
        raise bad(why)
    return Endpoint(transport, host, port, path)
