#!/usr/bin/env bash
# Sets up a fresh Debian/Ubuntu machine for MILI: redis-server and redis-cli, a venv, and the Python deps.
# Usage: scripts/bootstrap.sh [--dev]   (the demo's dependencies; --dev adds the test dependencies)
#        scripts/bootstrap.sh --offline DIR [--venv PATH] [--python PYTHON]   (no network: see bootstrap_offline.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--offline" ] && { shift; exec scripts/bootstrap_offline.sh "$@"; }

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  echo "[bootstrap] apt-get install $*"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

# redis-server runs every mode the tests start: one server, cluster nodes and sentinels (as
# `redis-server --sentinel`: Debian's redis-sentinel package adds only a service around it).
# redis-cli (redis-tools) makes and reshards the tests' clusters (`redis-cli --cluster`).
{ command -v redis-server && command -v redis-cli; } >/dev/null || apt_install redis-server redis-tools
# The gateway's tests read raw Server-Sent Events with curl -N; the board's run in headless Chromium.
[ "${1:-}" = "--dev" ] && { command -v curl >/dev/null || apt_install curl; }
[ "${1:-}" = "--dev" ] && { command -v chromium >/dev/null || apt_install chromium; }
python3 -c 'import sys; assert sys.version_info >= (3, 10), "MILI needs Python 3.10+"'

if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating the virtual environment .venv"
  python3 -m venv .venv 2>/dev/null || { apt_install python3-venv; python3 -m venv .venv; }
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

# Without a GPU, pin the CPU build: an unpinned torch pulls several GB of CUDA wheels. Whether torch
# is installed is looked up, not imported: an import takes seconds, on every run.
if ! .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)'; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "[bootstrap] installing torch (a GPU is present: the CUDA build, several GB)"
    pip install torch
  else
    echo "[bootstrap] installing torch 2.13.0, the CPU build (about a minute)"
    pip install torch==2.13.0
  fi
fi

extra="demo"  # the demo's gateway and the openai SDK it calls
[ "${1:-}" = "--dev" ] && extra="dev"
# The install is skipped when this checkout's requirements are installed already: the stamp holds a
# digest of pyproject.toml, the checkout's path (the install is editable) and the Python, for each
# extra installed; `dev` holds `demo`. A changed pyproject.toml, a moved checkout or a new venv
# installs again. (pip itself takes ~40 s to find that nothing changed.)
digest=$( { cat pyproject.toml; pwd; .venv/bin/python -VV; } | sha256sum | cut -d' ' -f1)
installed() { [ -f ".venv/.mili-$1" ] && [ "$(cat ".venv/.mili-$1")" = "$digest" ]; }
if installed "$extra" || { [ "$extra" = demo ] && installed dev; }; then
  echo "[bootstrap] the ${extra} requirements are installed already (pyproject.toml unchanged)"
else
  echo "[bootstrap] installing MILI and its ${extra} requirements into .venv (a few minutes the first time)"
  rm -f .venv/.mili-demo .venv/.mili-dev
  pip install -e ".[${extra}]"
  echo "$digest" > ".venv/.mili-$extra"
fi
echo "[bootstrap] ready: $(.venv/bin/python -c 'from importlib.metadata import version as v; print("torch", v("torch"), "triton", v("triton"))')"
