"""Options fail at construction with a message naming the bad value; the CLI fails at start
with one line naming it, before TensorFlow is imported or any process starts."""

from __future__ import annotations

import dataclasses
import importlib
import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import AUTO_QUEUE_BATCHES, ProducerOptions, TrainerOptions
from stagefeed.common.schema import image_schema
from tests.conftest import cli_env, run_cli


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"dtype": "float64"}, "float64"),
        ({"num_classes": -3}, "num_classes"),
    ],
)
def test_bad_spec_names_the_value(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        image_schema(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"connect": "localhost:5555"}, "localhost:5555"),
        ({"workers": 0}, "workers"),
        ({"inflight_mb": -1}, "inflight_mb"),
        ({"rate": -1}, "rate"),
        ({"source": "not a ref"}, "not a ref"),
    ],
)
def test_bad_producer_option_names_the_value(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        ProducerOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"bind": "tcp://*"}, "tcp://\\*"),
        ({"enqueue_threads": 0}, "enqueue_threads"),
        ({"steps": -1}, "steps"),
        ({"queue_mb": 1}, "queue_mb=1"),
        ({"stage_depth": 0}, "stage_depth"),
        ({"device": "tpu"}, "tpu"),
        ({"max_message_mb": 1}, "max_message_mb=1"),
    ],
)
def test_bad_trainer_option_names_the_value(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        TrainerOptions(**kwargs)


def test_byte_budgets_derive_message_counts():
    spec = image_schema()  # 158.9 MB float32 batch
    assert ProducerOptions(inflight_mb=512).max_unsent(spec) == 3
    assert ProducerOptions(inflight_mb=1).max_unsent(spec) == 1
    assert TrainerOptions(schema=spec, queue_mb=2048).queue_capacity == 13
    small = image_schema(batch_size=256, dtype="uint8")
    assert TrainerOptions(schema=small, queue_mb=2048).queue_capacity == 54
    assert TrainerOptions(schema=spec).max_message_bytes == spec.batch_bytes + 2**20


def test_the_queue_is_as_deep_as_the_run_can_use():
    tiny = image_schema(batch_size=2)  # 1.2 MiB: 2048 MiB would hold 1736 of them
    assert TrainerOptions(schema=tiny, steps=0).queue_capacity == AUTO_QUEUE_BATCHES
    assert TrainerOptions(schema=tiny, steps=3).queue_capacity == 5  # 2 warm-up + 3 planned
    assert TrainerOptions(schema=tiny, epochs=2, steps_per_epoch=10).queue_capacity == 20
    # A run whose length its passes decide plans no steps: the cap alone.
    assert TrainerOptions(schema=tiny, steps=3, length_by_passes=True).queue_capacity == 64
    assert TrainerOptions(schema=tiny, steps=3, queue_batches=500).queue_capacity == 500
    assert TrainerOptions(schema=tiny, queue_batches=5000).queue_capacity == 1736  # queue_mb
    assert TrainerOptions(schema=image_schema(), steps=0).queue_capacity == 13  # queue_mb


# ---- every float option refuses NaN and the infinities ---------------------------------------

# The modules that define option classes (frozen dataclasses named *Options or *Config): every
# float field of every such class is covered, a new one automatically.
OPTION_MODULES = (
    "stagefeed.common.options", "stagefeed.consumer.observe.monitor", "stagefeed.bench.config",
)  # fmt: skip
OPTION_SUFFIXES = ("Options", "Config")


def _float_options() -> list[tuple[type, str]]:
    found = []
    for module in map(importlib.import_module, OPTION_MODULES):
        for cls in vars(module).values():
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                continue
            if cls.__module__ != module.__name__ or not cls.__name__.endswith(OPTION_SUFFIXES):
                continue
            for field in dataclasses.fields(cls):
                if field.init and "float" in str(field.type).replace(" ", "").split("|"):
                    found.append((cls, field.name))
    return found


FLOAT_OPTIONS = _float_options()


def test_the_float_options_are_found():
    names = {f"{cls.__name__}.{name}" for cls, name in FLOAT_OPTIONS}
    assert {
        "ProducerOptions.inflight_mb", "ProducerOptions.rate", "TrainerOptions.queue_mb",
        "TrainerOptions.max_message_mb", "TrainerOptions.wait_log_s",
        "TrainerOptions.producer_timeout_s", "ObserveOptions.progress_s",
        "ObserveOptions.wire_mb_s", "StepsConfig.queue_mb", "IngestConfig.gb",
    } <= names, names  # fmt: skip


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("cls", "name"), FLOAT_OPTIONS, ids=[f"{c.__name__}.{n}" for c, n in FLOAT_OPTIONS]
)
def test_every_float_option_refuses_non_finite_values(cls, name, value):
    with pytest.raises(ConfigError) as info:
        cls(**{name: value})
    assert name in str(info.value) and repr(value) in str(info.value), info.value


@given(option=st.sampled_from(FLOAT_OPTIONS), value=st.floats())
def test_a_float_option_is_finite_or_refused_naming_it(option, value):
    cls, name = option
    try:
        options = cls(**{name: value})
    except ConfigError as exc:
        assert name in str(exc), exc
        return
    assert math.isfinite(getattr(options, name))


# ---- every count is an int, never a bool -----------------------------------------------------


def _int_options() -> list[tuple[type, str]]:
    """Every field of ``common.options``' option classes declared ``int`` (or ``int | None``)."""
    module = importlib.import_module("stagefeed.common.options")
    found = []
    for cls in vars(module).values():
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__name__.endswith(
            "Options"
        ):
            for field in dataclasses.fields(cls):
                if field.init and "int" in str(field.type).replace(" ", "").split("|"):
                    found.append((cls, field.name))
    return found


INT_OPTIONS = _int_options()


def test_the_int_options_are_found():
    names = {f"{cls.__name__}.{name}" for cls, name in INT_OPTIONS}
    assert {
        "ProducerOptions.workers", "ProducerOptions.max_batches", "ProducerOptions.seed",
        "TrainerOptions.enqueue_threads", "TrainerOptions.stage_depth", "TrainerOptions.steps",
        "TrainerOptions.credit_per_producer", "TrainerOptions.shm_producers",
        "TrainerOptions.epochs", "ObserveOptions.metrics_port",
    } <= names, names  # fmt: skip


@pytest.mark.parametrize("value", [True, False], ids=["True", "False"])
@pytest.mark.parametrize(
    ("cls", "name"), INT_OPTIONS, ids=[f"{c.__name__}.{n}" for c, n in INT_OPTIONS]
)
def test_every_int_option_refuses_a_bool_naming_the_field(cls, name, value):
    """``True`` is an int to Python: ``TrainerOptions(recv_threads=True)`` once made a trainer
    with one enqueue thread, ``ProducerOptions(workers=True)`` one worker."""
    with pytest.raises(ConfigError) as info:
        cls(**{name: value})
    assert f"{name} must be an integer" in str(info.value), info.value


def test_recv_threads_is_a_deprecated_name_of_enqueue_threads():
    """``recv_threads`` counted the enqueue threads; its old keyword and attribute still work,
    each with a DeprecationWarning, and the old keyword is checked like the new one."""
    with pytest.warns(DeprecationWarning, match="recv_threads is deprecated: say enqueue_threads"):
        options = TrainerOptions(recv_threads=3)
    assert options.enqueue_threads == 3
    with pytest.warns(DeprecationWarning, match="say enqueue_threads"):
        assert options.recv_threads == 3
    for bad in (True, 0, 65, 2.0):
        with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="recv_threads"):
            TrainerOptions(recv_threads=bad)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="not recv_threads"):
        TrainerOptions(recv_threads=2, enqueue_threads=2)


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--recv-threads", "0"], {}, "--recv-threads is deprecated: say --enqueue-threads"),
        ([], {"STAGEFEED_RECV_THREADS": "0"},
         "STAGEFEED_RECV_THREADS is deprecated: say STAGEFEED_ENQUEUE_THREADS"),
    ],
    ids=["flag", "variable"],
)  # fmt: skip
def test_the_old_enqueue_threads_flag_and_variable_are_taken_and_said_deprecated(
    without_tensorflow, args, env, said
):
    """``--recv-threads`` and ``STAGEFEED_RECV_THREADS`` still set the enqueue threads (here 0,
    refused under the new name) and the log says what to write instead."""
    done = run_cli(["train", *args, "--batch-size", "2"], timeout=60,
                   env={**without_tensorflow, **env})  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and said in lines[0], done.stderr
    assert lines[1] == "stagefeed: error: enqueue_threads must be an integer in [1, 64], got 0"


# ---- the CLI: a bad value stops the command at start, before TensorFlow or any process --------

_NO_TENSORFLOW = """\
import sys


class NoTensorFlow:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] == "tensorflow":
            raise ImportError("tensorflow imported before the flags were checked")
        return None


sys.meta_path.insert(0, NoTensorFlow)
"""


@pytest.fixture
def without_tensorflow(tmp_path):
    """A CLI environment in which importing TensorFlow fails: a command that got as far as
    TensorFlow would end in that ImportError, not in the one-line error of a checked flag."""
    site = tmp_path / "no-tensorflow-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_NO_TENSORFLOW)
    env = cli_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return env


def _not_a_dir(tmp_path) -> str:
    (tmp_path / "plain-file").write_text("")
    return str(tmp_path / "plain-file" / "logs")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["train", "--json", "/proc/x.json"], "/proc/x.json"),
        (["run", "--json", "/proc/x.json"], "/proc/x.json"),
        (["train", "--json", "{tmp}/missing/summary.json"], "{tmp}/missing/summary.json"),
        (["train", "--json", "{tmp}"], "{tmp}"),
        (["train", "--logdir", "/proc/stagefeed-logs"], "/proc/stagefeed-logs"),
        (["run", "--logdir", "{not_a_dir}"], "{not_a_dir}"),
        (["train", "--bind", "tcp://127.0.0.1:99999"], "tcp://127.0.0.1:99999"),
        (["train", "--bind", "tcp://[::1:5555"], "tcp://[::1:5555"),
        (["produce", "--connect", "tcp://host:0"], "tcp://host:0"),
        (["produce", "--connect", "tcp://*:5555"], "tcp://*:5555"),
        (["train", "--metrics-port", "0", "--metrics-bind", "10.0.0.256"], "10.0.0.256"),
    ],
)
def test_cli_fails_at_start_with_one_line_naming_the_value(
    tmp_path, without_tensorflow, args, named
):
    fill = {"tmp": str(tmp_path), "not_a_dir": _not_a_dir(tmp_path)}
    args = [a.format(**fill) for a in args]
    named = named.format(**fill)
    began = time.monotonic()
    done = run_cli([*args, "--batch-size", "2"], timeout=60, env=without_tensorflow)
    took = time.monotonic() - began
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("stagefeed: error: ") and repr(named) in lines[0], lines[0]
    assert done.stdout == ""
    assert took < 30  # generous: nothing slow (TensorFlow, a process) was started
    leftovers = list(tmp_path.rglob("*.json"))
    assert not leftovers  # the check wrote nothing it kept


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["train", "--queue-mb", "nan"], "queue_mb must be a finite number > 0, got nan"),
        (["train", "--queue-mb", "inf"], "queue_mb must be a finite number > 0, got inf"),
        (["train", "--max-message-mb", "inf"], "max_message_mb must be a finite number >= 0"),
        (["train", "--max-message-mb", "nan"], "max_message_mb must be a finite number >= 0"),
        (["train", "--producer-timeout-s", "nan"], "producer_timeout_s must be a finite number"),
        (["train", "--progress-s", "inf"], "progress_s must be a finite number > 0, got inf"),
        (["run", "--rate", "nan"], "rate must be a finite number >= 0, got nan"),
        (["produce", "--inflight-mb", "nan"], "inflight_mb must be a finite number > 0"),
    ],
)
def test_a_non_finite_number_fails_at_start_in_one_line(without_tensorflow, args, named):
    done = run_cli([*args, "--batch-size", "2"], timeout=60, env=without_tensorflow)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"stagefeed: error: {named}"), done.stderr
    assert done.stdout == ""


def _typed_flags() -> list[tuple[list[str], str]]:
    """(command words, its first flag that takes an int or a float), for every command."""
    import argparse

    from stagefeed.cli import build_parser

    found = []

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        actions = parser._actions  # noqa: SLF001 - argparse keeps its flags there
        for action in actions:
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                for name, sub in action.choices.items():
                    walk(sub, [*words, name])
        typed = [a for a in actions if a.option_strings and a.type in (int, float)]
        if words and typed:
            found.append((words, typed[0].option_strings[0]))

    walk(build_parser(), [])
    return found


TYPED_FLAGS = _typed_flags()


def test_every_command_has_a_typed_flag_to_try():
    commands = {" ".join(words) for words, _ in TYPED_FLAGS}
    assert {"train", "run", "produce", "health", "keygen", "bench steps", "bench ingest"} <= (
        commands
    ), commands


@pytest.mark.parametrize(
    ("words", "flag"), TYPED_FLAGS, ids=[" ".join(w) for w, _ in TYPED_FLAGS]
)
def test_a_value_of_the_wrong_type_fails_in_one_line_for_every_command(
    without_tensorflow, words, flag
):
    """argparse's own errors are the one ``stagefeed: error:`` line, not its usage block."""
    done = run_cli([*words, flag, "1.5x"], timeout=60, env=without_tensorflow)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"stagefeed: error: argument {flag}: invalid "), lines[0]
    assert "'1.5x'" in lines[0] and done.stdout == ""


def test_steps_of_one_and_a_half_fails_in_one_line(without_tensorflow):
    done = run_cli(["train", "--steps", "1.5"], timeout=60, env=without_tensorflow)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "stagefeed: error: argument --steps: invalid int value: '1.5' "
        "(see stagefeed train --help)"
    ]


def test_health_refuses_a_non_finite_timeout_in_one_line(without_tensorflow):
    done = run_cli(["health", "--timeout-s", "inf"], timeout=60, env=without_tensorflow)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "stagefeed: error: --timeout-s must be a finite number > 0, got inf"
    ]


def test_cli_reads_the_paths_from_the_environment_too(without_tensorflow):
    env = {**without_tensorflow, "STAGEFEED_JSON": "/proc/x.json"}
    done = run_cli(["train", "--batch-size", "2"], timeout=60, env=env)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "stagefeed: error: --json '/proc/x.json' cannot be written: No such file or directory"
    ]


def test_the_bound_on_bytes_held_is_the_documented_one() -> None:
    """docs/guarantees.md: with the defaults of ``stagefeed train`` (batch 256 float32), 3321
    MiB of batch data whatever the number of producers that follow the protocol, plus 2
    messages per connection that does not."""
    options = TrainerOptions()
    batch = options.schema.batch_bytes
    assert options.queue_capacity == 13
    assert round(options.held_bytes_bound(0) / 2**20) == 3321
    assert options.held_bytes_bound(3) - options.held_bytes_bound(0) == 3 * 2 * (batch + 2**20)


def test_the_producer_timeout_flag_reaches_the_options_and_a_bad_one_fails_at_start() -> None:
    from stagefeed.cli import build_parser, trainer_options

    args = build_parser().parse_args(["train", "--producer-timeout-s", "3.5"])
    assert trainer_options(args, "tcp://127.0.0.1:*").producer_timeout_s == 3.5
    done = run_cli(["train", "--producer-timeout-s", "0"])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "stagefeed: error: producer_timeout_s must be a finite number > 0, got 0.0"
    )
