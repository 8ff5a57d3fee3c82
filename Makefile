# The two set-up commands of the README. Each one installs what it needs into .venv.
.PHONY: demo test lint setup

setup:
	scripts/setup.sh

demo:
	scripts/setup.sh
	.venv/bin/rolloutlog demo

# The suite on TEST_WORKERS pytest-xdist workers (more than the cores pay: tests wait on
# child processes, PostgreSQL and disk; the figures are in docs/benchmarks.md). loadgroup
# keeps the tests of one session vLLM engine on one worker. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 4
test:
	scripts/setup.sh --vllm
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
