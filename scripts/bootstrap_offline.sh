#!/usr/bin/env bash
# Installs MILI from an offline bundle (scripts/bundle.sh) on a host with no package index, keeping
# the host's own torch and triton: a venv layered over the host's python3 (its packages stay
# visible, behind the venv's), the bundle's wheels with --no-deps, this tree as an editable install,
# and the bundle's redis-server and redis-cli in the venv's bin. Nothing reaches the network.
#
# Usage: scripts/bootstrap.sh --offline DIR [--venv PATH] [--python PYTHON]
#   --venv    where the venv goes (default .venv)
#   --python  the host's interpreter, the one with torch and triton (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '7,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
log() { echo "[bootstrap] $*"; }
die() { echo "bootstrap.sh --offline: $*" >&2; exit 1; }

bundle="" venv=.venv python=python3
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv=${2:?}; shift 2 ;;
    --python) python=${2:?}; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "bootstrap.sh --offline: unknown option $1" >&2; usage ;;
    *) [ -z "$bundle" ] || usage; bundle=$1; shift ;;
  esac
done
[ -n "$bundle" ] || usage
[ -f "$bundle/MANIFEST" ] || die "$bundle holds no MANIFEST: not a bundle from scripts/bundle.sh"
bundle=$(cd "$bundle" && pwd)
manifest=$bundle/MANIFEST

verify_bundle() {
  # A truncated or altered file fails here, before anything is installed.
  (cd "$bundle" && awk '$1 == "wheel" { print $5 "  wheels/" $4 } $1 == "file" { print $3 "  " $2 }' MANIFEST \
    | sha256sum --quiet --strict -c -) || die "the bundle's files do not match its MANIFEST"
  if ls "$bundle"/wheels | grep -qiE '^(torch|triton)-'; then
    die "the bundle holds a torch or triton wheel; the host's own are kept (rebuild it with scripts/bundle.sh)"
  fi
}

check_host_python() {
  command -v "$python" >/dev/null || die "no $python here"
  local wanted have
  wanted=$(awk '$1 == "python" { print $2 }' "$manifest")
  have=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  case "$have." in
    "$wanted".*) ;;
    *) die "the bundle is for Python $wanted, and $python is $have" ;;
  esac
  "$python" -c 'import torch, triton' 2>/dev/null \
    || die "$python cannot import torch and triton; the bundle brings neither (the host's CUDA build is kept)"
  log "host python: $(command -v "$python") ($have); $("$python" -c 'import torch, triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)), triton {triton.__version__}")')"
}

# The venv sees the host's site-packages after its own, through a .pth that runs site.addsitedir
# (so the host's own .pth files apply too): torch and the rest come from the host, the bundle's
# wheels from the venv. A plain `venv --system-site-packages` would not do: when python3 is itself
# a venv (/opt/torch/.venv on the GPU machines), that flag reaches the base interpreter's packages.
LAYER=_mili_host_site.pth
make_venv() {
  local site
  if [ -e "$venv" ]; then
    [ -n "$(ls "$venv"/lib/python3*/site-packages/$LAYER 2>/dev/null)" ] \
      || die "$venv exists and is no venv of bootstrap --offline; remove it or pass --venv"
    log "reusing $venv"
    return
  fi
  "$python" -m venv --without-pip "$venv"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$python" -c 'import site
for d in site.getsitepackages():
    print(f"import site; site.addsitedir({d!r})")' >"$site/$LAYER"
  "$venv/bin/python" -m pip --version >/dev/null 2>&1 || die "the host's python has no pip to install with"
}

pip_offline() { "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-index --no-deps "$@"; }

install_redis() {
  local binary
  rm -rf "$venv/redis"
  cp -R "$bundle/redis" "$venv/redis"
  for binary in redis-server redis-cli; do
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$(cd "$venv" && pwd)/redis/bin/$binary" >"$venv/bin/$binary"
    chmod +x "$venv/bin/$binary"
  done
  log "redis-server: $venv/bin/redis-server ($("$venv/bin/redis-server" --version | cut -d' ' -f3))"
}

verify_bundle
check_host_python
make_venv
log "installing $(ls "$bundle"/wheels | wc -l) wheels from $bundle (no index, no dependencies resolved)"
pip_offline "$bundle"/wheels/*.whl
# --no-build-isolation: the build backend (setuptools) comes from the host instead of the index.
pip_offline --no-build-isolation -e .
install_redis
"$venv/bin/python" scripts/bundle_check.py "$manifest" || die "the environment is incomplete (above)"
log "ready: $venv over $(command -v "$python"). Put its bin first on PATH for the tests' redis-server:"
log "  export PATH=$(cd "$venv" && pwd)/bin:\$PATH    (or: source $venv/bin/activate)"
