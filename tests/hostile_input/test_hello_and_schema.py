"""Hellos the trainer refuses: a forged, malformed or oversized schema, a bad name, a hello
nested 1000 deep; refusals are counted without flooding the log; a flood of hellos is
bounded by the live-connection limit and forgotten once silent."""

from __future__ import annotations

import re
import time

import msgpack
import pytest

from stagefeed.common.schema import image_schema
from tests.helpers import procs
from tests.hostile import wire
from tests.hostile.peers import Peer
from tests.hostile_input.harness import (
    WAIT_S,
    check_cases,
    check_dropped,
    check_peak,
    check_still_training,
    delta,
    new_peer,
    one,
    require,
)

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

LIVE_CONNECTIONS = 256  # consumer/intake/dispatch.py MAX_LIVE_CONNECTIONS
PRODUCER_TIMEOUT_S = 10.0  # the default of --producer-timeout-s
TRAINER_SCHEMA = image_schema(batch_size=2)


def test_hello_nested_1000_deep(target):
    deep_name = wire.packed_map(
        {"v": wire.V, "t": "hello", "schema": None}, {"name": wire.nested_lists(1000)}
    )
    deep_schema = wire.packed_map(
        {"v": wire.V, "t": "hello", "name": "deep"},
        {"schema": b"\x82" + msgpack.packb("batch_size") + msgpack.packb(2)
         + msgpack.packb("arrays") + b"\x91" + wire.nested_maps(999)},
    )  # fmt: skip
    p = new_peer(target, hello=False)
    check_cases(target, [one("name", [deep_name], "header_fields"),
                         one("schema", [deep_schema], "hello")], p)  # fmt: skip
    assert p.welcome is None
    assert_told(p, ["header_fields", "hello"])


def assert_told(p: Peer, reasons: list[str]) -> None:
    """The peer of malformed hellos got one ``refused`` per hello, naming each one's reason."""
    assert p.wait(lambda: len(p.refusals) >= len(reasons)), p.refusals
    assert [r["reason"] for r in p.refusals] == reasons, p.refusals
    assert all(r["detail"] for r in p.refusals), p.refusals


def refusal_count(m: procs.Metrics, reason: str) -> int:
    """Refused hellos of ``reason`` as the metrics show them: as drops by reason, or in a family
    of their own whose name says refused (either fix satisfies the test)."""
    total = m.dropped.get(reason, 0)
    for (name, labels), value in m.samples.items():
        if "refus" in name and ("reason", reason) in labels:
            total += int(value)
    return total


def test_hello_with_a_forged_schema_is_refused(target):
    forged = {
        "batch-size": {**TRAINER_SCHEMA.to_dict(), "batch_size": 3},
        "uint8": image_schema(batch_size=2, dtype="uint8").to_dict(),
        "bounds": image_schema(batch_size=2, num_classes=10).to_dict(),
        "names": {**TRAINER_SCHEMA.to_dict(), "arrays": [{"name": "x", "dtype": "uint8"}]},
    }
    start = target.metrics()
    for key, schema in forged.items():
        p = new_peer(target, hello=False)
        refused_before = refusal_count(target.metrics(), "spec_mismatch")
        reply = p.hello(f"forged-{key}", schema)
        assert reply["t"] == "refused" and reply["reason"] == "spec_mismatch", (key, reply)
        # Counted by reason (the log says so at most once per reason every 5 s).
        after = target.wait(lambda m, n=refused_before: refusal_count(m, "spec_mismatch") > n)
        assert refusal_count(after, "spec_mismatch") == refused_before + 1, key
        # A batch on the refused connection is a batch before an accepted hello.
        check_dropped(target, p, one(key, wire.good_frames(0), "no_hello"))
        assert p.wait(lambda p=p: len(p.refusals) == 2), p.refusals
        assert p.refusals[1]["reason"] == "no_hello"
    check_still_training(target, start)


def test_refused_hello_is_counted(target):
    before = target.metrics()
    p = new_peer(target, hello=False)
    reply = p.hello("forged-counted", {**TRAINER_SCHEMA.to_dict(), "batch_size": 3})
    require(reply["t"] == "refused", f"a forged schema was welcomed: {reply}")
    after = target.wait(
        lambda m: refusal_count(m, "spec_mismatch") > refusal_count(before, "spec_mismatch"), 2
    )
    target.booked.update(delta(after.dropped, before.dropped))
    assert refusal_count(after, "spec_mismatch") == refusal_count(before, "spec_mismatch") + 1


def test_refused_hellos_do_not_flood_the_log(target):
    def lines() -> int:
        return len(re.findall(r"refused producer", procs.log_text(target.trainer.started)))

    before = lines()
    refused_before = refusal_count(target.metrics(), "spec_mismatch")
    forged = {**TRAINER_SCHEMA.to_dict(), "batch_size": 3}
    peers = [new_peer(target, hello=False) for _ in range(50)]
    for i, p in enumerate(peers):
        p.send(wire.hello(f"log-flood-{i}", forged))
    for p in peers:
        require(p.wait(lambda p=p: bool(p.refusals)), "a forged hello got no refusal")
    # The trainer books a refusal, and logs it unless the log is throttled, before it replies
    # (consumer/books/ledger.py Ledger.refused): with every reply in, all 50 had their chance.
    assert refusal_count(target.metrics(), "spec_mismatch") == refused_before + 50
    assert lines() - before <= 5


def _schema_with(arrays: list, batch_size: int = 2) -> dict:
    return {"batch_size": batch_size, "arrays": arrays}


def test_hello_with_a_malformed_or_oversized_schema(target):
    u8 = {"name": "x", "dtype": "uint8"}
    schemas = {
        "17-arrays": _schema_with([{"name": f"a{i}", "dtype": "uint8"} for i in range(17)]),
        "no-arrays": _schema_with([]),
        "object-dtype": _schema_with([{"name": "x", "dtype": "object"}]),
        "long-name": _schema_with([{"name": "x" * 65, "dtype": "uint8"}]),
        "twice": _schema_with([u8, u8]),
        "huge-dim": _schema_with([{**u8, "shape": [2**40]}]),
        "nine-dims": _schema_with([{**u8, "shape": [1] * 9}]),
        "bounds-float": _schema_with([{"name": "x", "dtype": "float32", "bounds": [0, 1]}]),
        "scale-nan": _schema_with([{"name": "x", "dtype": "float32", "scale": float("nan")}]),
        "huge-batch": _schema_with([u8], batch_size=2**40),
        "unknown-key": {**TRAINER_SCHEMA.to_dict(), "pickle": "cos\nsystem\n"},
        "a-list": None,
    }
    cases = []
    for key, schema in schemas.items():
        frames = wire.hello("malformed", schema)
        if schema is None:  # not a map: the header's own type check
            frames = [wire.packed_map({"v": wire.V, "t": "hello", "name": "m"},
                                         {"schema": msgpack.packb([1])})]  # fmt: skip
        cases.append(one(key, frames, "hello" if schema is not None else "header_fields"))
    oversized = _schema_with([{"name": "x" * 60, "dtype": "uint8"}] * 300)
    cases.append(one("oversized", wire.hello("oversized", oversized), "header_size"))
    p = new_peer(target, hello=False)
    check_cases(target, cases, p)
    assert p.welcome is None
    # Each is told why, but the oversized one: its header was never read, so not known as a
    # hello.
    assert_told(p, [reason for case in cases[:-1] for reason in case.expected])


def test_hello_with_a_bad_name(target):
    names = {"empty": "", "65-chars": "x" * 65, "tab": "tab\there", "newline": "new\nline"}
    p = new_peer(target, hello=False)
    check_cases(target, [one(k, wire.hello(n), "hello") for k, n in names.items()], p)
    assert p.welcome is None
    assert_told(p, ["hello"] * len(names))


def test_hello_flood_is_bounded_and_the_good_producer_keeps_training(target):
    """300 connections say hello: fewer than the trainer's live-connection limit are welcomed,
    the rest refused ``peer_limit``; memory stays in budget and training goes on. Once silent
    they are forgotten, and a new connection is welcomed again."""
    before = target.metrics()
    target.peak.reset()
    flood = [Peer(target.ctx, target.trainer.endpoint, timeout_s=WAIT_S)
             for _ in range(300)]  # fmt: skip
    target.keep_open.extend(flood)
    for i, p in enumerate(flood):
        p.send(wire.hello(f"flood-{i}"))
    for p in flood:
        assert p.wait(lambda p=p: p.welcome is not None or bool(p.refusals)), "no reply"
    welcomed = [p for p in flood if p.welcome is not None]
    refused = [p for p in flood if p.welcome is None]
    assert 0 < len(welcomed) < LIVE_CONNECTIONS
    assert len(refused) >= len(flood) - LIVE_CONNECTIONS
    assert {r["reason"] for p in refused for r in p.refusals} == {"peer_limit"}
    after = check_still_training(target, before)
    assert delta(after.dropped, before.dropped) == {}
    check_peak(target)
    # Silent connections that delivered nothing are forgotten: a new hello is welcome again.
    flooded = time.monotonic()

    def forgotten(m: procs.Metrics) -> bool:
        if target.good is None:  # no labels to look at: the time it takes
            return time.monotonic() > flooded + PRODUCER_TIMEOUT_S + 2
        return not any(label.startswith("flood-") for label in m.received)

    assert forgotten(target.wait(forgotten, PRODUCER_TIMEOUT_S + 10)), "flood still in the books"
    late = new_peer(target, hello=False)
    reply = late.hello("after-the-flood")
    assert reply["t"] == "welcome", reply
    late.send(wire.control("end", seq=0))
    check_still_training(target, target.metrics())
