"""``StepRecorder``'s ``steps.jsonl`` across a restart: the history before the resumed step is kept."""

from __future__ import annotations

import json

from resihp_lightning.callbacks.progress import StepRecorder


def _write(path, steps):
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / (s + 1)}) + "\n" for s in steps))


def test_a_resumed_run_keeps_the_steps_before_its_checkpoint_and_drops_the_ones_it_redoes(tmp_path):
    recorder = StepRecorder(tmp_path)
    _write(recorder.path, range(12))  # the run died after step 11; its checkpoint is at step 8
    recorder._keep_steps_before(8)
    assert [json.loads(line)["step"] for line in recorder.path.read_text().splitlines()] == list(range(8))


def test_a_fresh_run_starts_an_empty_file(tmp_path):
    recorder = StepRecorder(tmp_path)
    _write(recorder.path, range(5))  # a previous run's file in the same run directory
    recorder._keep_steps_before(0)
    assert recorder.path.read_text() == ""
    recorder.path.unlink()
    recorder._keep_steps_before(3)  # a resume whose file is gone: nothing to keep, no error
    assert recorder.path.read_text() == ""
