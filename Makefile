# The two set-up commands of the README. Each one installs what it needs into .venv.
.PHONY: demo test lint typecheck setup

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

# mypy over the installed packages (rolloutlog.eventstore, rolloutlog.controller), found
# through the strict editable install's link tree that scripts/setup.sh makes.
typecheck:
	.venv/bin/mypy
