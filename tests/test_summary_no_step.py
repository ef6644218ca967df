"""A run that trained no step says so in its summary in words (issue 28): not ``ms/step median
None``, ``stall None%`` and ``loss None -> None (finite: False)``. A real ``stagefeed train``
process stopped with SIGTERM before any producer came."""

from __future__ import annotations

from tests.helpers import procs


def test_a_run_with_no_step_says_no_step_trained(tmp_path):
    spawn = procs.Spawner(tmp_path)
    try:
        trainer = procs.Trainer(spawn, "--steps", "5")
        summary = trainer.stop()
    finally:
        spawn.kill_all()
    text = procs.log_text(trainer.started)
    assert summary["steps"] == 0 and summary["warmup_steps"] == 0, summary
    assert "  no step trained: no step time, stall or loss" in text, text[-3000:]
    assert "None" not in text[text.index("stagefeed summary"):], text[-3000:]
