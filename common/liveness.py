"""Noticing a connection that went quiet: ZeroMQ heartbeats and TCP keepalive, on both ends.

A trainer that dies on its host (power, kernel panic, a network partition) sends no FIN and
no RST: without help its producers' connections stay "up" until TCP gives up on unacknowledged
data, many minutes later, and a producer keeps holding batches for it. And connection trackers
between the two (IPVS in front of a Kubernetes Service, a NAT) drop an idle connection after
their own timeout (IPVS: 900 s) without telling either end. So every producer DEALER and
every trainer ROUTER sets (``configure``):

- ZeroMQ heartbeats (ZMTP PING/PONG, libzmq >= 4.2): a PING every ``HEARTBEAT_IVL_S``; a
  connection from which nothing arrives for ``timeout_s`` after a PING is closed, which the
  producer's socket monitor reports (``producer.session``: "lost the trainer at ENDPOINT")
  and libzmq then reconnects. The timeout must exceed one batch's send time: the PONG queues
  behind the batch on the wire (zeromq/libzmq#2709), so ``heartbeat_timeout_s`` derives it
  from the message size at a conservative ``LINK_FLOOR_MIB_S``, never under ``MIN_TIMEOUT_S``
  (``--heartbeat-timeout-s`` on producers overrides it);
- TCP keepalive: the kernel probes a connection idle for ``KEEPALIVE_IDLE_S``, every
  ``KEEPALIVE_INTVL_S``, ``KEEPALIVE_CNT`` times: a dead peer is found even where heartbeats
  are not spoken (an older peer), and no tracker sees the connection idle for long.

libzmq copies these options into each connection when it is made: a change applies to the
next connection, not to one already up. Options of ``tcp://`` only; ``ipc://`` ignores them.
"""

from __future__ import annotations

import zmq

MIB = 2**20
HEARTBEAT_IVL_S = 2.0
MIN_TIMEOUT_S = 10.0
# The slowest link planned for: 100 Mbit/s Ethernet carries about 11.9 MiB/s; a batch must be
# on the wire within half the timeout at this speed.
LINK_FLOOR_MIB_S = 10.0
# A producer that adopts the trainer's schema does not know its batch size before the first
# welcome: its first connection uses this (reconnections get the derived timeout).
UNKNOWN_SIZE_TIMEOUT_S = 60.0
KEEPALIVE_IDLE_S = 60
KEEPALIVE_INTVL_S = 10
KEEPALIVE_CNT = 6


def heartbeat_timeout_s(message_bytes: int) -> float:
    """Seconds a connection may stay silent: twice one message's send time at
    ``LINK_FLOOR_MIB_S``, at least ``MIN_TIMEOUT_S`` (1 MiB: 10 s; 151 MiB: 30.2 s)."""
    return max(MIN_TIMEOUT_S, 2.0 * message_bytes / (LINK_FLOOR_MIB_S * MIB))


def configure(sock: zmq.Socket, timeout_s: float) -> None:
    """Heartbeats (closing a connection silent ``timeout_s`` after a PING) and TCP keepalive
    on ``sock``, for the connections it makes or accepts from now on."""
    interval_ms = int(min(HEARTBEAT_IVL_S, timeout_s / 2) * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, interval_ms))
    set_timeout(sock, timeout_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)


def set_timeout(sock: zmq.Socket, timeout_s: float) -> None:
    """The heartbeat timeout of ``sock``'s next connections."""
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(timeout_s * 1000)))
