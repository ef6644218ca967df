"""Environment inputs under bad values (issue 28), through the real CLI: ``TF_CONFIG`` nested
100,000 deep, thousands of digits in ``JOB_COMPLETION_INDEX``, in a ``TF_CONFIG`` port, in
``--connect-tf-config`` and in a ``STAGEFEED_*`` value each fail at start in one short line
naming the value (exit 2, no traceback), before TensorFlow loads.

Covers common/tf_config.py, stagefeed/producer_flags.py and stagefeed/envflags.py.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, run_cli

DIGITS = "9" * 5000
NESTED = "[" * 100_000
INDEXED_JOB = {
    "STAGEFEED_TRAINER_WORKERS": "2", "STAGEFEED_TRAINER_JOB": "trainer",
    "STAGEFEED_TRAINER_SERVICE": "trainer", "STAGEFEED_TF_PORT": "2222",
}  # fmt: skip
LONG_PORT = json.dumps({"cluster": {"worker": [f"a:{DIGITS}"]}, "task": {"type": "worker"}})

CASES = {
    "tf-config-nested-train": (["train"], {"TF_CONFIG": NESTED}, "TF_CONFIG is nested too deeply"),
    "tf-config-nested-produce": (
        ["produce", "--connect-tf-config", "5555"], {"TF_CONFIG": NESTED},
        "TF_CONFIG is nested too deeply",
    ),
    "tf-config-port-digits": (
        ["train"], {"TF_CONFIG": LONG_PORT}, "TF_CONFIG cluster.worker[0] 'a:9999",
    ),
    "job-completion-index-digits": (
        ["train"], {**INDEXED_JOB, "JOB_COMPLETION_INDEX": DIGITS},
        "JOB_COMPLETION_INDEX='9999",
    ),
    "connect-tf-config-digits": (
        ["produce", "--connect-tf-config", DIGITS], {}, "--connect-tf-config '9999",
    ),
    "connect-tf-config-env-digits": (
        ["produce"], {"STAGEFEED_CONNECT_TF_CONFIG": DIGITS}, "STAGEFEED_CONNECT_TF_CONFIG '999",
    ),
    "stagefeed-steps-digits": (["train"], {"STAGEFEED_STEPS": DIGITS}, "STAGEFEED_STEPS='999"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_environment_input_fails_at_start_in_one_short_line(case):
    args, env, named = CASES[case]
    done = run_cli([*args, "--batch-size", "2"], timeout=60, env=cli_env(**env))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"stagefeed: error: {named}"), lines[:3]
    assert len(lines[0]) < 500, lines[0][:600]  # the value is named, not printed in full
    assert "TensorFlow" not in done.stderr
