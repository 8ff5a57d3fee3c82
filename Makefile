# The two set-up commands of the README. Each one installs what it needs into .venv.
.PHONY: demo test lint setup

setup:
	scripts/setup.sh

demo:
	scripts/setup.sh
	.venv/bin/rolloutlog demo

test:
	scripts/setup.sh --vllm
	scripts/lint_imports.sh
	.venv/bin/python -m pytest

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && scripts/lint_imports.sh
