"""CURVE authentication: ``stagefeed keygen``, ``common.curve``, and a trainer with an allow-list.

The unit tests use real pyzmq sockets on loopback; the last tests run a real trainer with
``--curve-keys`` and real producers holding an allowed key, an unknown key, and no key.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import threading

import pytest
import zmq
import zmq.auth
import zmq.utils.monitor

from stagefeed.common import curve
from stagefeed.common.errors import ConfigError
from stagefeed.keygen import write_keys
from tests.conftest import TINY, run_cli
from tests.helpers import procs

WAIT_MS = 10_000


@pytest.fixture
def keys(tmp_path) -> str:
    """A key set with two remote producers, of which client-1 is then struck off the list."""
    path = str(tmp_path / "keys")
    write_keys(path, 2)
    os.remove(os.path.join(path, curve.AUTHORIZED, "client-1.key"))
    return path


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keygen_writes_the_documented_layout(tmp_path):
    path = str(tmp_path / "keys")
    assert write_keys(path, 2) == [os.path.join(path, "client-0"), os.path.join(path, "client-1")]
    server_public = curve.load_public_key(os.path.join(path, "server.key"))
    assert curve.load_key_pair(os.path.join(path, "server.key_secret"))[0] == server_public
    allowed = zmq.auth.load_certificates(os.path.join(path, curve.AUTHORIZED))
    clients = [path, os.path.join(path, "client-0"), os.path.join(path, "client-1")]
    for folder in clients:
        public, _ = curve.load_key_pair(os.path.join(folder, "client.key_secret"))
        assert allowed.get(public), f"{folder} is not on the allow-list"
        assert curve.load_public_key(os.path.join(folder, "server.key")) == server_public
        assert _mode(folder) == 0o700
        assert _mode(os.path.join(folder, "client.key_secret")) == 0o600
    assert len(allowed) == 3
    assert _mode(os.path.join(path, "server.key_secret")) == 0o600
    # What a remote producer gets holds no trainer secret.
    assert not any(name.startswith("server.key_secret") for name in os.listdir(clients[1]))


def test_keygen_never_overwrites(tmp_path):
    path = str(tmp_path / "keys")
    write_keys(path, 0)
    with pytest.raises(ConfigError, match="never overwritten"):
        write_keys(path, 1)


def test_keygen_command(tmp_path):
    path = str(tmp_path / "keys")
    done = run_cli(["keygen", path, "--clients", "1"])
    assert done.returncode == 0, done.stderr
    assert "--curve-keys" in done.stdout
    assert os.path.isfile(os.path.join(path, "client-0", "client.key_secret"))
    again = run_cli(["keygen", path])
    assert again.returncode == 2 and "never overwritten" in again.stderr


def test_bad_key_directories_fail_at_start_naming_the_file(tmp_path, keys):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="nowhere"):
        curve.server_configurator(missing)
    with pytest.raises(ConfigError, match=r"client-0.server\.key_secret"):
        curve.server_configurator(os.path.join(keys, "client-0"))
    with pytest.raises(ConfigError, match=r"client\.key_secret"):
        curve.client_configurator(missing)
    empty = tmp_path / "empty-allow-list"
    shutil.copytree(keys, empty)
    shutil.rmtree(empty / curve.AUTHORIZED)
    os.mkdir(empty / curve.AUTHORIZED)
    with pytest.raises(ConfigError, match="no public key"):
        curve.server_configurator(str(empty))
    broken = tmp_path / "broken"
    shutil.copytree(keys, broken)
    (broken / "client.key_secret").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="not a ZeroMQ certificate"):
        curve.client_configurator(str(broken))


def _push(ctx: zmq.Context, port: int, keys_dir: str | None) -> tuple[zmq.Socket, zmq.Socket]:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_dir is not None:
        curve.client_configurator(keys_dir)(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILED)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock, monitor


_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def _handshake(monitor: zmq.Socket) -> int:
    assert monitor.poll(WAIT_MS), "no handshake outcome"
    return zmq.utils.monitor.recv_monitor_message(monitor)["event"]


def test_only_allowed_keys_get_a_message_through(keys):
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    server = curve.server_configurator(keys)
    pull = server_ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)  # as the trainer receives: one message at a time
    pull.setsockopt(zmq.LINGER, 0)
    sockets = []
    try:
        server(pull)
        assert pull.rcvhwm == curve.MIN_RCVHWM
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        unknown = _push(client_ctx, port, os.path.join(keys, "client-1"))
        plain = _push(client_ctx, port, None)
        allowed = _push(client_ctx, port, os.path.join(keys, "client-0"))
        sockets = [s for pair in (unknown, plain, allowed) for s in pair]
        assert _handshake(unknown[1]) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert _handshake(plain[1]) & _FAILED
        assert _handshake(allowed[1]) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        for name, (sock, _) in (("unknown", unknown), ("plain", plain)):
            # A refused peer may not even have a pipe to queue into (EAGAIN): both are fine.
            with contextlib.suppress(zmq.Again):
                sock.send_multipart([name.encode(), b"payload"], zmq.NOBLOCK)
        allowed[0].send_multipart([b"allowed", b"payload"])
        assert pull.poll(WAIT_MS)
        assert pull.recv_multipart() == [b"allowed", b"payload"]
        assert not pull.poll(500), "a refused peer got a message in"
    finally:
        for sock in sockets:
            sock.close(linger=0)
        pull.close(linger=0)
        assert server.close() == []
        client_ctx.term()
        _term_within(server_ctx, 10)


def test_curve_applies_over_ipc_too(keys, tmp_path):
    """libzmq 4.3.5 runs the ZAP handler for ipc connections as well (docs/guarantees.md)."""
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    server = curve.server_configurator(keys)
    pull = server_ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path / 'curve.sock'}"
    sockets = []
    try:
        server(pull)
        pull.bind(endpoint)
        for folder in (os.path.join(keys, "client-1"), None, os.path.join(keys, "client-0")):
            sock = client_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if folder is not None:
                curve.client_configurator(folder)(sock)
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILED)
            sock.connect(endpoint)
            sockets += [sock, monitor]
            outcome = _handshake(monitor)
            assert bool(outcome & _FAILED) == (folder is None or folder.endswith("client-1"))
            with contextlib.suppress(zmq.Again):
                sock.send(str(folder).encode(), zmq.NOBLOCK)
        assert pull.poll(WAIT_MS)
        assert pull.recv() == os.path.join(keys, "client-0").encode()
        assert not pull.poll(500)
    finally:
        for sock in sockets:
            sock.close(linger=0)
        pull.close(linger=0)
        assert server.close() == []
        client_ctx.term()
        _term_within(server_ctx, 10)


def test_close_stops_the_authenticator_and_is_idempotent(keys):
    ctx = zmq.Context()
    server = curve.server_configurator(keys)
    sock = ctx.socket(zmq.PULL)
    server(sock)
    assert server.running
    assert curve.AUTH_THREAD_NAME in {t.name for t in threading.enumerate()}
    sock.close(linger=0)
    assert server.close() == []
    assert server.close() == []
    assert not server.running
    assert curve.AUTH_THREAD_NAME not in {t.name for t in threading.enumerate()}
    _term_within(ctx, 10)  # the ZAP socket is closed: term() does not wait on it


def test_libzmq_curve_with_rcvhwm_1_delivers_nothing(keys):
    """Why ServerCurve raises the receive HWM to 2 (libzmq 4.3.5); if this starts failing,
    libzmq changed and ``MIN_RCVHWM`` can be revisited."""
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    server = curve.server_configurator(keys)
    pull = server_ctx.socket(zmq.PULL)
    server(pull)
    pull.rcvhwm = 1
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push, monitor = _push(client_ctx, port, os.path.join(keys, "client-0"))
    try:
        assert _handshake(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        push.send_multipart([b"h", b"x" * 1000])
        assert pull.poll(WAIT_MS) == zmq.POLLIN
        with pytest.raises(zmq.Again):
            pull.recv_multipart(zmq.NOBLOCK)
    finally:
        monitor.close(linger=0)
        push.close(linger=0)
        pull.close(linger=0)
        server.close()
        client_ctx.term()
        _term_within(server_ctx, 10)


def _term_within(ctx: zmq.Context, timeout: float) -> None:
    thread = threading.Thread(target=ctx.term, name="test-ctx-term", daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "zmq.Context.term() hung: a socket was left open"


def test_produce_with_unusable_keys_fails_at_start(tmp_path):
    done = run_cli(["produce", *TINY, "--curve-keys", str(tmp_path / "nowhere")], timeout=60)
    assert done.returncode == 2
    assert "nowhere" in done.stderr and "client.key_secret" in done.stderr


@pytest.mark.slow
def test_trainer_admits_only_producers_on_its_allow_list(spawn, keys):
    trainer = procs.Trainer(spawn, "--curve-keys", keys)
    produce = ["produce", "--connect", trainer.endpoint, *TINY, "--rate", "5"]
    allowed = spawn([*produce, "--curve-keys", os.path.join(keys, "client-0")], name="allowed")
    refused = {
        "unknown": spawn(
            [*produce, "--curve-keys", os.path.join(keys, "client-1")], name="unknown"
        ),
        "plain": spawn(produce, name="plain"),
    }
    for name, proc in refused.items():
        # libzmq never retries a refused handshake: the producer says why and exits.
        assert proc.wait(60) == 3, f"{name}: " + procs.log_text(proc)
        assert "refused the handshake" in procs.log_text(proc), name
        assert "Traceback" not in procs.log_text(proc), name
    (allowed_worker,) = procs.workers_of(allowed, 1)
    live = trainer.wait_metrics(lambda m: sum(m.trained.values()) >= 3, 120)
    assert list(live.received) == procs.producer_ids_of(allowed_worker.pid, live.received)

    summary = trainer.stop()
    assert len(summary["producers"]) == 1, summary["producers"]
    assert procs.producer_ids_of(allowed_worker.pid, summary["producers"])
    assert summary["batches"]["dropped"] == 0
    connections = summary["connections"]
    assert connections.get("handshake_failed_auth", 0) >= 1  # the unknown key
    # Plain text against CURVE: libzmq reports it as a protocol error or without detail.
    other = ("handshake_failed_protocol", "handshake_failed_no_detail")
    assert sum(connections.get(kind, 0) for kind in other) >= 1
    assert "Traceback" not in procs.log_text(trainer.started)


@pytest.mark.slow
def test_run_with_one_keys_directory(tmp_path, keys):
    """``stagefeed run --curve-keys DIR``: the trainer and local producers share DIR."""
    done = run_cli(
        ["run", *TINY, "--producers", "1", "--steps", "2", "--warmup-steps", "0"]
        + ["--queue-mb", "4", "--curve-keys", keys, "--json", str(tmp_path / "run.json")],
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CURVE on" in done.stderr
    with open(tmp_path / "run.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["batches"]["trained"] == 2
    assert summary["connections"]["handshake_succeeded"] >= 1


def test_a_producer_key_is_named_by_a_hex_fingerprint_never_a_slice_of_z85():
    """Issue 20 item 9: books named a key by 8 z85 characters (``key Ltpb.N$}``)."""
    public, _secret = zmq.curve_keypair()
    name = curve.key_fingerprint(public)
    assert re.fullmatch(r"key [0-9a-f]{8}", name), name
    assert name == curve.key_fingerprint(public.decode())  # bytes or text, the same name
    assert name != curve.key_fingerprint(zmq.curve_keypair()[0])
