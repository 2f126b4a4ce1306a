#!/usr/bin/env bash
# Sets up the machine (see bootstrap.sh) and runs the demo: an embedded redis-server and one
# worker on the `tiny` preset, with jobs submitted, streamed and collected through the client.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/python -m worker demo "$@"
# The commands live in the venv, which this script cannot activate in the caller's shell.
echo "[run] mili, mili-worker and mili-gateway are in .venv/bin: 'source .venv/bin/activate' puts them on your PATH"
