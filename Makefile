# The two set-up commands of the README. Each one installs what it needs into .venv.
.PHONY: demo test test-durations lint typecheck setup

setup:
	scripts/setup.sh

demo:
	scripts/setup.sh
	.venv/bin/rolloutlog demo

# The suite on TEST_WORKERS pytest-xdist workers (more than the 2 cores: tests wait on
# child processes, PostgreSQL and disk; 3, not 4, so that the end-to-end vLLM tests' engines
# fit in 24 GiB; figures in docs/benchmarks.md). tests/conftest.py's scheduler keeps the
# tests of one session vLLM engine (and of a file with a module-scoped fixture) on one
# worker, and hands out the longest first by tests/durations.json. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 3
test:
	scripts/setup.sh --vllm
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

# The same run, rewriting tests/durations.json (the scheduler's estimates) from its
# durations: after adding or changing slow tests. Commit the file.
test-durations:
	scripts/setup.sh --vllm
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25 \
	  --durations-table=tests/durations.json

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && scripts/lint_imports.sh

# mypy over the installed packages (rolloutlog.eventstore, rolloutlog.controller), found
# through the strict editable install's link tree that scripts/setup.sh makes.
typecheck:
	.venv/bin/mypy
