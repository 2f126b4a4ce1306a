#!/usr/bin/env bash
# Sets up the machine (see bootstrap.sh) and runs the demo: an embedded redis-server and one
# worker on the `tiny` preset, with jobs submitted, streamed and collected through the client.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m worker demo "$@"
