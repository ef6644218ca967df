"""``stagefeed produce --shard-group G/K``: several produce commands feeding one run, each
its own group of shards (docs/resume.md, "The source contract").

- ``worker_info``: worker ``i`` of ``--workers N`` in group ``G`` of ``K`` is shard
  ``G + i*K`` of ``K*N`` (groups interleave), seeded ``seed + G + i*K``;
- a bad value, on the command line or in ``STAGEFEED_SHARD_GROUP``, fails at start in one
  line naming it (exit 2);
- real processes: one trainer with ``--save`` fed by two ``produce --workers 1`` commands,
  groups ``0/2`` and ``1/2``, trains every row exactly ``EPOCHS`` times and books two
  complete shards.
"""

from __future__ import annotations

import json

import pytest

from stagefeed.cli import build_parser
from stagefeed.common import protocol
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import ProducerOptions
from stagefeed.common.position import MAX_SHARDS
from stagefeed.producer.worker import group_fields, worker_info
from tests.conftest import cli_env, free_tcp_port, run_cli
from tests.helpers.procs import log_text
from tests.helpers.resume_models import counts_in, miscounted, stream

# A trainer nobody listens at: every bad value must fail before connecting.
NOWHERE = ["produce", "--connect", "tcp://127.0.0.1:9", "--max-batches", "1"]


def test_worker_info_is_the_global_shard_and_seed():
    infos = [
        worker_info(ProducerOptions(workers=3, seed=10, shard_group=(group, 2)), i)
        for group in (0, 1)
        for i in range(3)
    ]
    assert [(w.index, w.count, w.seed) for w in infos] == [
        (shard, 6, 10 + shard) for shard in (0, 2, 4, 1, 3, 5)
    ]
    assert len({w.producer_id for w in infos}) == 6
    # The default is the only group: shard i of N, as before --shard-group.
    alone = worker_info(ProducerOptions(workers=3, seed=10), 2)
    assert (alone.index, alone.count, alone.seed) == (2, 3, 12)


def test_each_hello_names_the_shards_of_its_produce_command():
    """The group a cluster worker waits for once one of its shards delivered (the hello's
    ``group_first``/``group_shards``): exactly the shards ``worker_info`` gives the command."""
    for group in (0, 1):
        options = ProducerOptions(workers=3, shard_group=(group, 2))
        fields = group_fields(options)
        named = protocol.group_of_hello(fields)
        assert list(named) == [worker_info(options, i).index for i in range(3)]


def test_the_flag_and_its_variable_give_the_group(monkeypatch):
    parser = build_parser()
    assert parser.parse_args(["produce"]).shard_group == (0, 1)
    assert parser.parse_args(["produce", "--shard-group", "1/4"]).shard_group == (1, 4)
    monkeypatch.setenv("STAGEFEED_SHARD_GROUP", " 3 / 4 ")
    assert build_parser().parse_args(["produce"]).shard_group == (3, 4)
    # the command line wins over the environment
    assert build_parser().parse_args(["produce", "--shard-group", "0/4"]).shard_group == (0, 4)


@pytest.mark.parametrize(
    ("group", "workers", "message"),
    [
        ((3, 2), 1, r"shard_group 3/2: expected GROUP/GROUPS with 0 <= GROUP < GROUPS"),
        ((0, 0), 1, r"shard_group 0/0: expected GROUP/GROUPS"),
        ((-1, 2), 1, r"shard_group -1/2: expected GROUP/GROUPS"),
        ((0, MAX_SHARDS), 2, rf"shard_group 0/{MAX_SHARDS} with workers 2: .* more than"),
        ((0, True), 1, r"shard_group must be \(GROUP, GROUPS\), two integers, got \(0, True\)"),
        ("0/2", 1, r"shard_group must be \(GROUP, GROUPS\), two integers, got '0/2'"),
    ],
)
def test_options_refuse_a_bad_group_naming_it(group, workers, message):
    with pytest.raises(ConfigError, match=message):
        ProducerOptions(workers=workers, shard_group=group)


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("3/2", "shard_group 3/2: expected GROUP/GROUPS with 0 <= GROUP < GROUPS"),
        ("0/0", "shard_group 0/0: expected GROUP/GROUPS with 0 <= GROUP < GROUPS"),
        (
            "a/b",
            "argument --shard-group: 'a/b': expected GROUP/GROUPS, such as 0/2 "
            "(see stagefeed produce --help)",
        ),
        (
            "-1/2",
            "argument --shard-group: '-1/2': expected GROUP/GROUPS, such as 0/2 "
            "(see stagefeed produce --help)",
        ),
        (
            f"0/{MAX_SHARDS + 1}",
            f"shard_group 0/{MAX_SHARDS + 1} with workers 1: {MAX_SHARDS + 1} shards, "
            f"more than {MAX_SHARDS}",
        ),
    ],
)
def test_a_bad_flag_fails_at_start_in_one_line_naming_it(value, line):
    done = run_cli([*NOWHERE, f"--shard-group={value}"], timeout=60)
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"stagefeed: error: {line}"])


@pytest.mark.parametrize(
    ("value", "line"),
    [
        (
            "a/b",
            "STAGEFEED_SHARD_GROUP='a/b' is not a valid --shard-group: 'a/b': expected "
            "GROUP/GROUPS, such as 0/2",
        ),
        ("2/2", "shard_group 2/2: expected GROUP/GROUPS with 0 <= GROUP < GROUPS"),
    ],
)
def test_a_bad_variable_fails_at_start_in_one_line_naming_it(value, line):
    done = run_cli(NOWHERE, timeout=60, env=cli_env(STAGEFEED_SHARD_GROUP=value))
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"stagefeed: error: {line}"])


# ---- real processes: two produce commands, one run -------------------------------------------

MODEL = [
    "--schema", "tests.helpers.resume_models:SCHEMA", "--model",
        "tests.helpers.resume_models:row_counter",
    "--steps", "0", "--warmup-steps", "0", "--checkpoint-every", "5", "--progress-s", "100",
]  # fmt: skip
SOURCE = ["--schema", "tests.helpers.resume_models:SCHEMA", "--source",
    "tests.helpers.resume_models:rows"]
GROUPS = 2
# Shard g of 2 carries rows g, g+2, ...: its stream, every pass, is half the run's steps.
PER_SHARD = len(stream(0, GROUPS))
TIMEOUT_S = 180


@pytest.mark.slow
def test_two_produce_groups_train_every_row_exactly_epochs_times(spawn, tmp_path):
    save, summary, port = tmp_path / "save", tmp_path / "summary.json", free_tcp_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    # The producers first: they wait for the trainer, so neither group's end can come before
    # the other has said hello (the end of data is every shard's stream complete anyway).
    produce = ["produce", "--connect", endpoint, "--workers", "1", *SOURCE]
    producers = [
        spawn([*produce, "--shard-group", f"{group}/{GROUPS}"], f"group-{group}")
        for group in range(GROUPS)
    ]
    trainer = spawn(
        ["train", "--bind", endpoint, *MODEL, "--save", str(save), "--json", str(summary)],
        "trainer",
    )
    assert trainer.wait(TIMEOUT_S) == 0, log_text(trainer)[-4000:]
    for group, producer in enumerate(producers):
        assert producer.wait(TIMEOUT_S) == 0, log_text(producer)[-3000:]
        text = log_text(producer)
        assert f"shard {group} of {GROUPS}" in text, text[-3000:]  # the global shard, logged
        assert f"finished: {PER_SHARD} batches (seq 0..{PER_SHARD - 1}); trainer refused 0" in (
            text
        ), text[-3000:]
    counts = counts_in(str(save / "model.ckpt"))
    assert not miscounted(counts), miscounted(counts)
    state = json.loads((save / "state.json").read_text())
    assert state["step"] == GROUPS * PER_SHARD
    assert state["finished"] == "every producer's data ended"
    position = state["input"]
    assert position["shards"] == GROUPS and position["approximate"] == []
    assert {s: (p["next"], p["above"], p["end"]) for s, p in position["streams"].items()} == {
        str(g): (PER_SHARD, [], PER_SHARD) for g in range(GROUPS)
    }
    books = json.loads(summary.read_text())
    assert (books["dropped_by_reason"], books["refused_producers"]) == ({}, {}), books
    assert books["batches"]["received"] == books["batches"]["trained"] == GROUPS * PER_SHARD
