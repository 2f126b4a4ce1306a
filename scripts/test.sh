#!/usr/bin/env bash
# Sets up the machine (see bootstrap.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh --dev
exec .venv/bin/python -m pytest tests "$@"
