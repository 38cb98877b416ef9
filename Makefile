# The two commands of the README. Both are idempotent and do the whole set-up themselves.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo plan-demo test test-fast docs clean

setup:
	@bash scripts/setup.sh

# Fine-tunes a small Llama-style model on 4 CPU processes through an injected 2x slowdown
# (detect, re-plan, migrate live); prints the throughput table and writes runs/demo-*/timeline.png.
demo: setup
	$(PY) examples/finetune.py --config examples/configs/demo_cpu.yaml

# The planner alone: best layout for 16 devices, two of them at half speed.
plan-demo: setup
	$(VENV)/bin/resihp plan examples/problems/two_slow_of_sixteen.json

# scripts/test_suite.sh: the files that measure compute speed alone, then the files that measure
# timeouts beside the rest of the suite (two tests at a time, pytest-xdist, at a lower CPU priority);
# every part always runs; any one failing fails the target (tests/timing_files.txt lists which is which).
TEST_WORKERS ?= 2
test: setup
	@TEST_WORKERS=$(TEST_WORKERS) PY=$(PY) bash scripts/test_suite.sh

# Skips the multi-process gloo tests (CI runs everything).
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not multiprocess"

# The documentation site (docs/_build/html), built from scratch: every warning fails it, broken
# cross-references to this package's names (-n) and broken links or anchors between the pages included.
docs: setup
	rm -rf docs/_build docs/_autosummary
	$(PY) -m sphinx -n -W --keep-going -E -b html docs docs/_build/html

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info docs/_build docs/_autosummary
