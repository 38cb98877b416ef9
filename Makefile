# The two commands of the README. Both are idempotent and do the whole set-up themselves.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/resihp plan examples/problems/two_slow_of_sixteen.json

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest

# Skips the multi-process gloo tests (CI runs everything).
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not multiprocess"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
