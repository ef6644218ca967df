"""A live shared-memory trainer against hostile same-host peers: forged, replayed, stale and
out-of-range descriptors, pools whose seals, size, layout or token are wrong, a producer that
tries to shrink its mapped pool, another user, and a pool that does not fit at start.

One canary trainer (``tests.helpers.shm_canary``) serves the whole module, fed by a real producer
all along: every attack must be refused and counted under its reason (the trainer's
Prometheus counters), and that producer must go on training, uncorrupted.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import resource
import socket
import subprocess
import time

import numpy as np
import pytest
import zmq

from stagefeed.common import protocol
from stagefeed.common.errors import BrokenError
from stagefeed.common.shm.fd_passing import FdChannel, offer_pool
from stagefeed.common.shm.layout import F_ADD_SEALS, F_SEAL_GROW, F_SEAL_SHRINK, SlotLayout
from stagefeed.common.shm.slots import SlotPool, reserve
from tests.conftest import REPO, cli, cli_env, wait_for
from tests.helpers import procs, shm_procs
from tests.helpers.shm_canary import SCHEMA

pytestmark = pytest.mark.slow  # TensorFlow in a subprocess

LAYOUT = SlotLayout.of(SCHEMA.wire())


class Live:
    def __init__(self, spawn: procs.Spawner) -> None:
        self.trainer = shm_procs.CanaryTrainer(spawn)
        self.producer = shm_procs.produce(spawn, self.trainer.endpoint, "--rate", "20", name="ok")
        (self.worker,) = procs.workers_of(self.producer, 1)
        self.trainer.trained_of(self.worker.pid, 3)

    def dropped(self) -> dict[str, int]:
        return self.trainer.metrics().dropped

    def trains_on(self) -> None:
        """The well-behaved producer is still being trained."""
        now = self.trainer.trained_of(self.worker.pid, 0)
        self.trainer.trained_of(self.worker.pid, now + 3)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    spawn = procs.Spawner(tmp_path_factory.mktemp("shm-hostile"))
    try:
        live = Live(spawn)
        yield live
        summary = live.trainer.stop()
        assert summary["loss_last"] == 0, "a corrupted batch was trained"
        assert not os.path.lexists(live.trainer.socket)
    finally:
        spawn.kill_all()


class Peer:
    """A hand-driven producer connection: hello with ``shm``, the welcome's offer, credit."""

    def __init__(self, live: Live, name: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(live.trainer.endpoint)
        self.sock.send(protocol.encode_control("hello", name=name, schema=None, shm=True))
        self.credit, self.verdicts, self.released = 0, {}, []
        self.details: dict[int, str] = {}
        self.welcome = self._until(lambda m: m["t"] == "welcome")
        self.credit += self.welcome["credit"]
        self.pool: SlotPool | None = None

    def _until(self, match, timeout_s: float = 60) -> dict:
        """Read until ``match(message)``, pinging meanwhile (a silent peer is forgotten, and
        credit held by peers gone silent comes back only when they are: up to 10 s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sock.poll(1000):
                self.sock.send(protocol.encode_control("ping"))
                continue
            message = protocol.decode_header(self.sock.recv(), protocol.FROM_TRAINER)
            if message["t"] == "credit":
                self.credit += message["n"]
            elif message["t"] == "dropped":
                self.verdicts[message["seq"]] = message["reason"]
                self.details[message["seq"]] = message.get("detail", "")
            elif message["t"] == "release":
                self.released.append((message["slot"], message["gen"]))
            if match(message):
                return message
        raise AssertionError(f"nothing matched in {timeout_s} s")

    def channel(self, token: str | None = None) -> FdChannel:
        channel = FdChannel.connect(self.welcome["shm_socket"], timeout=10)
        channel.send({"token": token or self.welcome["shm_token"]})
        reply, _ = channel.recv(timeout=10)
        if reply.get("ok") is not True:
            channel.close()
            raise BrokenError(f"token refused: {reply}")
        return channel

    def offer(self, slots: int | None = None) -> SlotPool:
        self.pool = SlotPool(LAYOUT, slots or self.welcome["shm_slots"])
        self._channel = self.channel()
        offer_pool(self._channel, self.pool)
        return self.pool

    def commit(self, seq: int, commit_seq: int | None = None) -> dict:
        """A slot filled for ``seq`` as the canary expects, committed (as ``commit_seq``)."""
        assert self.pool is not None
        slot = self.pool.acquire(timeout=10)
        arrays = self.pool.arrays(slot)
        arrays["pixels"].fill(seq % 251)
        arrays["tag"].fill(seq)
        return self.pool.commit(slot, seq if commit_seq is None else commit_seq)

    def send(self, desc, seq: int) -> None:
        if self.credit == 0:
            self._until(lambda m: self.credit > 0)
        self.credit -= 1
        self.sock.send(protocol.encode_control("shm_batch", seq=seq, desc=desc))

    def verdict(self, seq: int) -> str:
        if seq not in self.verdicts:
            self._until(lambda m: m["t"] == "dropped" and m["seq"] == seq)
        return self.verdicts[seq]

    def close(self) -> None:
        if self.pool is not None:
            self._channel.close()
            self.pool.close()
        self.sock.close(linger=0)
        self.ctx.term()


def counted(live: Live, before: dict[str, int], expected: dict[str, int]) -> dict[str, int]:
    """Wait until the trainer's drop counters grew by ``expected``; return the growth."""

    def growth() -> dict[str, int]:
        now = live.dropped()
        return {r: now.get(r, 0) - before.get(r, 0) for r in set(now) | set(expected)}

    wait_for(lambda: all(growth().get(r, 0) >= n for r, n in expected.items()), 30)
    return {r: n for r, n in growth().items() if n}


def test_hostile_descriptors_are_refused_by_reason_and_training_continues(live):
    before = live.dropped()
    a, b = Peer(live, "hostile-a"), Peer(live, "hostile-b")

    def check(cases: dict) -> None:
        for name, (desc, seq, reason) in cases.items():
            a.send(desc, seq)
            assert a.verdict(seq) == reason, name
            a.verdicts.pop(seq)

    try:
        pool = a.offer()
        good = a.commit(0)
        a.send(good, 0)
        a._until(lambda m: m["t"] == "release" and m["slot"] == good["slot"])  # trained
        cases = {
            "replayed": (good, 0, "shm_replay"),
            "forged pool": ({**good, "pool": "p1-forged", "seq": 1}, 1, "shm_pool"),
            "slot out of range": ({**good, "slot": pool.slots, "seq": 2}, 2, "shm_slot"),
            "forged generation": ({**good, "gen": good["gen"] + 7, "seq": 3}, 3, "shm_generation"),
            "not a descriptor": ({"pool": 1, "slot": 0, "gen": 1, "seq": 4}, 4, "shm_descriptor"),
            "extra key": ({**good, "seq": 5, "x": 1}, 5, "shm_descriptor"),
            "message seq differs": ({**a.commit(6), "seq": 6}, 60, "shm_descriptor"),
            "wrong seq": ({**a.commit(7, commit_seq=8), "seq": 7}, 7, "shm_sequence"),
        }
        check(cases)
        pool.release(good["slot"], good["gen"])  # free again: rewritten below, gen + 1
        skipped = []
        slot = pool.acquire(timeout=5)
        while slot != good["slot"]:  # the slot the stale descriptor names, a generation on
            skipped.append(slot)
            slot = pool.acquire(timeout=5)
        for other in skipped:
            pool.discard(other)
        check({
            "stale (slot reused)": (good, 0, "shm_generation"),
            "uncommitted": (
                {"pool": pool.pool_id, "slot": slot, "gen": pool.generation(slot), "seq": 9}, 9,
                "shm_uncommitted",
            ),
        })  # fmt: skip
        other = a.commit(10)
        b.send(other, 10)  # a connection naming another's pool
        assert b.verdict(10) == "shm_pool"
        expected = {"shm_replay": 1, "shm_pool": 2, "shm_slot": 1, "shm_generation": 2,
                    "shm_descriptor": 3, "shm_sequence": 1, "shm_uncommitted": 1}  # fmt: skip
        assert counted(live, before, expected) == expected
        live.trains_on()
    finally:
        a.close()
        b.close()


def test_a_batch_on_its_way_when_its_producer_closed_the_pool_is_trained(live):
    """The stop race: a descriptor still in ZeroMQ when its producer closed the pool channel,
    whose EOF reached the trainer first. The pool stays readable until the connection can
    deliver no more (``end`` here), so that batch is trained; then the pool leaves."""
    before = live.dropped()
    peer = Peer(live, "closes-first")
    try:
        pool = peer.offer()
        on_its_way = peer.commit(0)
        name = shm_procs.MEMFD + pool.pool_id
        assert name in shm_procs.memfds(live.trainer.pid)["maps"]
        peer._channel.close()  # the trainer sees EOF before the descriptor
        kept = f"pool {pool.pool_id}: its producer closed the channel; readable until"
        assert procs.wait_log(live.trainer.started, kept, 30), live.trainer.log()[-2000:]
        peer.send(on_its_way, 0)
        peer._until(lambda m: m["t"] == "release" and m["slot"] == on_its_way["slot"])
        assert 0 not in peer.verdicts  # trained, and its slot released
        assert name in shm_procs.memfds(live.trainer.pid)["maps"]
        peer.sock.send(protocol.encode_control("end", seq=1))
        assert wait_for(lambda: name not in shm_procs.memfds(live.trainer.pid)["maps"], 30), (
            f"the trainer still maps {name} after 30 s"
        )
        assert live.dropped() == before
        live.trains_on()
    finally:
        peer.pool = None  # its channel is closed already
        pool.close()
        peer.close()


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    reserve(fd, size)
    if seals:
        fcntl.fcntl(fd, F_ADD_SEALS, seals)
    return fd


def test_hostile_pool_offers_are_refused_by_reason(live):
    before = live.dropped()
    granted = None
    outcomes = {}

    def attempt(name: str, offer) -> None:
        peer = Peer(live, f"hostile-{name.replace(' ', '-')}")
        nonlocal granted
        granted = peer.welcome["shm_slots"]
        try:
            offer(peer)
            outcomes[name] = "accepted"
        except BrokenError as exc:
            outcomes[name] = str(exc)
        finally:
            peer.close()

    def raw(peer, header, fd) -> None:
        channel = peer.channel()
        try:
            channel.send(header, fd)
            reply, _ = channel.recv(timeout=10)
            raise BrokenError(f"refused: {reply}")
        finally:
            channel.close()
            if fd is not None:
                os.close(fd)

    announce = {"v": 1, "pool": "p1-hostile", "layout": LAYOUT.to_wire()}
    stride = LAYOUT.stride
    attempt("unknown token", lambda p: p.channel(token="00" * 16))
    attempt("unsealed fd", lambda p: raw(p, {**announce, "slots": 2}, _memfd(2 * stride, 0)))
    attempt("size differs", lambda p: raw(
        p, {**announce, "slots": 3}, _memfd(2 * stride, F_SEAL_SHRINK | F_SEAL_GROW)))
    attempt("no fd", lambda p: raw(p, {**announce, "slots": 2}, None))
    attempt("more slots than granted", lambda p: p.offer(slots=granted + 1))
    other = SlotLayout.of([("pixels", np.uint8, (4, 65536)), ("tag", np.int32, (4,))])
    with SlotPool(other, 2) as wrong:
        attempt("another layout", lambda p: raw(
            p, {**announce, "slots": 2, "layout": other.to_wire()}, os.dup(wrong.fd)))  # fmt: skip
    reasons = {
        "unknown token": "shm_token", "unsealed fd": "shm_seals", "size differs": "shm_pool_size",
        "no fd": "shm_fd", "more slots than granted": "shm_pool_size",
        "another layout": "spec_mismatch",
    }  # fmt: skip
    for name, reason in reasons.items():
        assert reason in outcomes[name], (name, outcomes[name])
    expected = {"shm_token": 1, "shm_seals": 1, "shm_pool_size": 2, "shm_fd": 1,
                "spec_mismatch": 1}  # fmt: skip
    assert counted(live, before, expected) == expected
    live.trains_on()


def test_a_producer_cannot_shrink_or_grow_its_mapped_pool(live):
    peer = Peer(live, "hostile-shrink")
    try:
        pool = peer.offer()
        for size in (0, pool.size // 2, pool.size * 2):
            with pytest.raises(PermissionError):  # EPERM: F_SEAL_SHRINK | F_SEAL_GROW
                os.ftruncate(pool.fd, size)
        assert os.fstat(pool.fd).st_size == pool.size
        desc = peer.commit(0)
        peer.send(desc, 0)  # the trainer still reads the pool, without a fault
        peer._until(lambda m: m["t"] == "release" and m["slot"] == desc["slot"])
        assert not peer.verdicts
        live.trains_on()
    finally:
        peer.close()


def _nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another uid")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user")


def _refused_as(user: pwd.struct_passwd, attempts: list) -> list[bool]:
    """Run each attempt in a child that dropped to ``user``; True where it was refused."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: leave through os._exit
        os.close(read)
        out = b""
        try:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            for attempt in attempts:
                try:
                    attempt()
                    out += b"0"
                except PermissionError:
                    out += b"1"
                except BaseException:  # noqa: BLE001 - reported as "not refused"
                    out += b"?"
        finally:
            os.write(write, out)
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        return [c == ord("1") for c in f.read()]


def _live_pool_mapping(pid: int) -> str:
    """A /proc map_files path of a pool the trainer maps now (pools retire on re-welcome, so
    a mapping read a moment ago may be gone: read again until one opens)."""
    for _ in range(50):
        with open(f"/proc/{pid}/maps") as f:
            ranges = [ln.split()[0] for ln in f if shm_procs.MEMFD in ln]
        for mapped in reversed(ranges):
            path = f"/proc/{pid}/map_files/{mapped}"
            try:
                os.close(os.open(path, os.O_RDONLY))
            except FileNotFoundError:
                continue
            return path
        time.sleep(0.1)
    raise AssertionError(f"the trainer {pid} maps no pool")


def test_another_user_can_neither_reach_nor_map_nor_write_a_pool(live):
    nobody = _nobody()
    producer_fd = min(shm_procs.memfd_links(live.worker.pid))
    trainer_map = _live_pool_mapping(live.trainer.pid)  # positive control: the paths are real

    def connect() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(live.trainer.socket)

    attempts = [
        connect,  # the 0700 directory
        lambda: os.close(os.open(producer_fd, os.O_RDWR)),  # the producer's memfd
        lambda: os.close(os.open(producer_fd, os.O_RDONLY)),
        lambda: os.close(os.open(trainer_map, os.O_RDONLY)),  # the trainer's mapping
    ]
    assert _refused_as(nobody, attempts) == [True] * len(attempts)
    live.trains_on()


def test_a_pool_that_does_not_fit_is_a_clear_error_at_start(live):
    """RLIMIT_FSIZE caps what a memfd may reserve: the producer must stop at start with the
    size and the fix, exit 2, never SIGBUS (or SIGXFSZ) later."""

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

    done = subprocess.run(
        cli("produce", "--connect", live.trainer.endpoint, "--transport", "shm",
            "--source", "tests.helpers.shm_canary:source"),
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
        preexec_fn=small_files,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    error = done.stderr
    assert "stagefeed: error:" in error and "EFBIG" in error, error
    assert "needs 2.3 MiB (9 slots)" in error and "--transport zmq" in error, error
    assert "Traceback" not in error
    live.trains_on()
