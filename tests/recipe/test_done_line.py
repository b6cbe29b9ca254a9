"""The run's last line (recipes/logs.py done_text): what each kind of ending tells a person to do next. The default
job's whole line: tests/recipe/test_default_run.py."""

from __future__ import annotations

from pathlib import Path

from recipes.logs import done_text

METRICS = Path("run/metrics.jsonl")
BASE = {"start_step": 0, "end_step": 10, "first_loss": 2.5, "last_loss": 2.0, "eval": None, "stopped_at": None}
KEPT = {"kept_checkpoints": ["run/checkpoints/step_00000005", "run/checkpoints/step_00000010"]}


def test_a_finished_run_names_the_key_that_ended_it():
    line = done_text({**BASE, **KEPT}, METRICS, "run/checkpoints", "trainer.stop_at")
    assert line == (
        "done: steps 0-10, loss 2.5000 -> 2.0000; 2 checkpoint(s) in run/checkpoints, newest step_00000010; to train "
        "on: the same command with trainer.stop_at above 10 (the summary: the last record of run/metrics.jsonl)"
    )


def test_a_stopped_run_resumes_only_with_checkpoints_and_an_eval_loss_stands_for_accuracy():
    stopped = {**BASE, "stopped_at": 10, "stopped_by": "SIGTERM", "eval": {"step": 10, "eval_loss": 1.25}}
    assert done_text({**stopped, **KEPT}, METRICS, "run/checkpoints", "trainer.max_steps") == (
        "done: steps 0-10, loss 2.5000 -> 2.0000; eval loss 1.2500 at step 10; 2 checkpoint(s) in run/checkpoints, "
        "newest step_00000010; stopped by SIGTERM: the same command resumes at step 10 (the summary: the last record "
        "of run/metrics.jsonl)"
    )
    assert done_text({**stopped, "kept_checkpoints": None}, METRICS, None, "trainer.max_steps") == (
        "done: steps 0-10, loss 2.5000 -> 2.0000; eval loss 1.2500 at step 10; no checkpoints "
        "(checkpoint.enabled=false); stopped by SIGTERM (the summary: the last record of run/metrics.jsonl)"
    )


def test_a_run_with_nothing_left_to_train_has_no_loss():
    nothing = {**BASE, "start_step": 10, "first_loss": None, "last_loss": None, **KEPT}
    assert done_text(nothing, METRICS, "run/checkpoints", "trainer.max_steps").startswith(
        "done: steps 10-10; 2 checkpoint(s)"
    )
