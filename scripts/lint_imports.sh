#!/usr/bin/env bash
# Check the import contracts of pyproject.toml ([tool.importlinter]) with import-linter.
# Installed, eventstore/, controller/ and migrations/ are rolloutlog.eventstore, ... (setuptools
# package-dir), but import-linter finds a package's modules by walking its folder. So this
# builds the installed layout out of symlinks in build/lint-imports and checks that.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tree=build/lint-imports
rm -rf "$tree"
mkdir -p "$tree/rolloutlog"
for entry in rolloutlog/*; do
    case "$entry" in *__pycache__) continue ;; esac
    ln -s "$root/$entry" "$tree/$entry"
done
for layer in eventstore controller migrations; do
    ln -s "$root/$layer" "$tree/rolloutlog/$layer"
done
cd "$tree"
exec "$root/.venv/bin/lint-imports" "$root/pyproject.toml" "$@"
