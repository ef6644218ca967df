"""The good producer until ``stagefeed produce`` speaks v2: ``GoodPeer`` in its own process.

``GoodPeer`` (``python -m tests.hostile good-peer``) says hello, adopts the trainer's schema and
sends valid batches against credit at a rate, pinging while idle. ``start_good_producer`` starts
it, or the real ``stagefeed produce`` once that speaks v2 (``cli_producer_speaks_v2`` guesses).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Sequence

import zmq

from stagefeed.common import protocol
from stagefeed.common.schema import Schema
from tests.hostile.peers import Peer
from tests.hostile.wire import control, valid_arrays

REPO = pathlib.Path(__file__).resolve().parents[2]


class GoodPeer:
    """A v2 producer: hello (adopting the trainer's schema), valid batches against credit at
    ``rate`` per second, a ping after a second idle, hello again if refused ``no_hello``.
    """

    def __init__(self, connect: str, name: str, rate: float, configure=None) -> None:
        self.connect, self.name, self.rate = connect, name, rate
        self.configure = configure
        self.stop = threading.Event()
        self.sent = 0

    def run(self) -> int:
        ctx = zmq.Context()
        peer = Peer(ctx, self.connect, self.configure)
        try:
            reply = peer.hello(self.name)
            if reply["t"] != "welcome":
                raise SystemExit(f"good-peer {self.name}: {reply}")
            schema = Schema.from_dict(reply["schema"], source="welcome")
            arrays = valid_arrays(schema)
            print(f"good-peer {self.name}: welcome, {schema.describe()}", flush=True)
            interval = 1.0 / self.rate if self.rate else 0.0
            next_at = time.monotonic()
            refused = 0
            while not self.stop.is_set():
                peer.pump(0.02)
                if len(peer.refusals) > refused:
                    refused = len(peer.refusals)
                    print(f"good-peer {self.name}: refused {peer.refusals[-1]}", flush=True)
                    peer.welcome = None
                    peer.hello(self.name)
                now = time.monotonic()
                if peer.credit > 0 and now >= next_at:
                    peer.credit -= 1
                    peer.send(protocol.encode_batch(self.sent, arrays), copy=False)
                    self.sent += 1
                    next_at = max(next_at + interval, now - interval)
                elif now - peer.last_sent > 1.0:
                    peer.send(control("ping"))
            peer.send(control("end", seq=self.sent))
            print(f"good-peer {self.name}: stopped after {self.sent} batches", flush=True)
            return 0
        finally:
            peer.sock.close(linger=2000)
            ctx.term()


def good_peer_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.hostile good-peer")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--name", default="good-peer")
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--curve-keys", default=None)
    args = parser.parse_args(argv)
    configure = None
    if args.curve_keys:
        from stagefeed.common.curve import client_configurator

        configure = client_configurator(args.curve_keys)
    peer = GoodPeer(args.connect, args.name, args.rate, configure)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: peer.stop.set())
    return peer.run()


def cli_producer_speaks_v2() -> bool:
    """Whether ``stagefeed produce`` is the v2 rewrite (it says hello) rather than v1.

    ``STAGEFEED_TEST_GOOD_PRODUCER=cli`` or ``=peer`` overrides the guess.
    """
    forced = os.environ.get("STAGEFEED_TEST_GOOD_PRODUCER")
    if forced in ("cli", "peer"):
        return forced == "cli"
    text = "".join(p.read_text(errors="replace") for p in (REPO / "producer").glob("*.py"))
    return "encode_control(" in text and "hello" in text and "protocol.encode(" not in text


class PeerProcess:
    """``python -m tests.hostile good-peer ...`` in its own process group; quacks like
    ``tests.conftest.Started`` so a ``procs.Spawner`` stops it with the rest."""

    def __init__(self, args: Sequence[str], log_path, env: dict[str, str]) -> None:
        import subprocess

        self.log_path = log_path
        self._log = open(log_path, "w+")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.hostile", "good-peer", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO),
            start_new_session=True,
        )

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()


def start_good_producer(
    spawn,
    endpoint: str,
    rate: str,
    *,
    name: str = "good",
    curve_keys: str | None = None,
    tiny: Sequence[str] = (),
):
    """The good producer: the real ``stagefeed produce`` once it speaks v2, else a GoodPeer.

    ``spawn`` is a ``tests.helpers.procs.Spawner``; the process is stopped by its ``kill_all``.
    """
    keys = ["--curve-keys", curve_keys] if curve_keys else []
    if cli_producer_speaks_v2():
        return spawn(["produce", "--connect", endpoint, *tiny, "--rate", rate, *keys], name=name)
    from tests.conftest import cli_env

    log_path = spawn.folder / f"{name}-{len(spawn.started)}.log"
    proc = PeerProcess(
        ["--connect", endpoint, "--name", name, "--rate", rate, *keys], log_path, cli_env()
    )
    spawn.started.append(proc)
    return proc
