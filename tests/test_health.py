"""``stagefeed health`` against real sockets on loopback: ZeroMQ peers, a non-ZeroMQ peer, none.

The check against a real trainer process (healthy while it trains, unhealthy once it ended)
is in test_compose_services.py, where the compose file's healthcheck runs beside the trainer
it describes.
"""

from __future__ import annotations

import socket
import threading

import pytest
import zmq

from stagefeed import health
from stagefeed.common import curve
from stagefeed.common.errors import ConfigError
from stagefeed.keygen import write_keys
from tests.conftest import cli_env, free_tcp_port, run_cli


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def bound(ctx: zmq.Context, kind: int, curve: bool = False) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        public, secret = zmq.curve_keypair()
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def test_a_router_socket_is_healthy(ctx):
    _, endpoint = bound(ctx, zmq.ROUTER)
    healthy, why = health.check(endpoint, timeout_s=5)
    assert healthy, why
    assert "ROUTER" in why


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_a_curve_trainer_is_unhealthy_to_a_check_without_keys(ctx):
    _, endpoint = bound(ctx, zmq.ROUTER, curve=True)
    healthy, why = health.check(endpoint, timeout_s=5)
    assert not healthy
    assert "security mechanism" in why, why


@pytest.fixture
def curve_trainer_socket(ctx, tmp_path):
    """A ROUTER socket set up as the trainer sets up its own with --curve-keys (real ZAP)."""
    keys = tmp_path / "keys"
    write_keys(str(keys), clients=0)
    server = curve.server_configurator(str(keys))
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    server(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield str(keys), f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    assert server.close() == []


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_with_the_trainers_keys_the_check_completes_a_curve_handshake(curve_trainer_socket):
    keys, endpoint = curve_trainer_socket
    healthy, why = health.check(endpoint, 5, curve.client_configurator(keys))
    assert healthy, why
    assert "ROUTER" in why and "CURVE" in why


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_a_key_the_trainer_does_not_list_is_unhealthy(curve_trainer_socket, tmp_path):
    _, endpoint = curve_trainer_socket
    other = tmp_path / "other-keys"
    write_keys(str(other), clients=0)
    healthy, why = health.check(endpoint, 5, curve.client_configurator(str(other)))
    assert not healthy
    assert "key" in why, why


def test_nothing_listening_is_unhealthy():
    healthy, why = health.check(f"tcp://127.0.0.1:{free_tcp_port()}", timeout_s=5)
    assert not healthy
    assert "connection refused" in why


def test_a_socket_of_the_wrong_type_is_unhealthy(ctx):
    _, endpoint = bound(ctx, zmq.PUB)  # ZeroMQ, but not something a DEALER can talk to
    healthy, why = health.check(endpoint, timeout_s=5)
    assert not healthy
    assert "not a ROUTER socket" in why, why


def test_a_peer_that_is_not_zeromq_is_unhealthy():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def answer_like_http() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4)
                conn.recv(64)

    thread = threading.Thread(target=answer_like_http, name="test-http-peer")
    thread.start()
    try:
        healthy, why = health.check(f"tcp://127.0.0.1:{server.getsockname()[1]}", timeout_s=5)
    finally:
        stop.set()
        thread.join(5)
        server.close()
    assert not healthy
    assert "handshake" in why, why


def test_a_silent_peer_times_out_unhealthy():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()  # accepts the TCP connection and never says a word
        healthy, why = health.check(f"tcp://127.0.0.1:{server.getsockname()[1]}", timeout_s=0.5)
    assert not healthy
    assert "within 0.5 s" in why


@pytest.mark.parametrize(
    ("bind", "expected"),
    [
        ("tcp://*:5555", "tcp://127.0.0.1:5555"),
        ("tcp://0.0.0.0:6000", "tcp://127.0.0.1:6000"),
        ("tcp://10.0.0.7:5555", "tcp://10.0.0.7:5555"),
        ("ipc:///tmp/stagefeed.sock", "ipc:///tmp/stagefeed.sock"),
    ],
)
def test_local_endpoint_of_a_bind_address(bind, expected):
    assert health.local_endpoint(bind) == expected


@pytest.mark.parametrize("bind", ["tcp://*:*", "udp://x:1", ""])
def test_local_endpoint_rejects_what_it_cannot_check(bind):
    with pytest.raises(ConfigError, match="STAGEFEED_BIND|random"):
        health.local_endpoint(bind)


def test_cli_reads_the_address_from_stagefeed_bind(ctx):
    _, endpoint = bound(ctx, zmq.ROUTER)
    port = endpoint.rsplit(":", 1)[1]
    ok = run_cli(["health"], timeout=30, env=cli_env(STAGEFEED_BIND=f"tcp://*:{port}"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("healthy:")
    assert f"tcp://127.0.0.1:{port}" in ok.stdout


def test_cli_exit_codes_for_unhealthy_and_bad_values():
    port = free_tcp_port()
    down = run_cli(["health", "--connect", f"tcp://127.0.0.1:{port}"], timeout=30)
    assert down.returncode == 1
    assert down.stdout.startswith("unhealthy:")
    bad = run_cli(["health"], timeout=30, env=cli_env(STAGEFEED_BIND="tcp://*:*"))
    assert bad.returncode == 2
    assert "tcp://*:*" in bad.stderr
