#!/usr/bin/env bash
# Builds an offline bundle for a host with no package index (the lent GPU machines): the wheels of
# every runtime and test dependency that host lacks, pinned to the versions installed in .venv (the
# ones the tests run with), Debian's redis-server with every library it loads, and a MANIFEST of
# what is in it, with checksums. scripts/bootstrap.sh --offline DIR installs from it.
#
# Usage: scripts/bundle.sh DIR [--python 3.12] [--platform manylinux_2_39_x86_64] [--all]
#   --python    the target's Python (3.12, or 3.12.3 where a marker tests the patch level)
#   --platform  the newest manylinux tag the target's glibc accepts; older tags are accepted too
#   --all       also the packages the GPU host already has (scripts/gpu_host_packages.txt),
#               for a bare host; never torch or triton: bootstrap keeps the host's own
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '8,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

dir="" python="3.12" platform="manylinux_2_39_x86_64" all=""  # the GPU host: Ubuntu, glibc 2.39 (seen 2026-11-26)
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python=${2:?}; shift 2 ;;
    --platform) platform=${2:?}; shift 2 ;;
    --all) all="--all"; shift ;;
    -h|--help) usage ;;
    -*) echo "bundle.sh: unknown option $1" >&2; usage ;;
    *) [ -z "$dir" ] || usage; dir=$1; shift ;;
  esac
done
[ -n "$dir" ] || usage
[[ "$python" =~ ^3\.[0-9]+(\.[0-9]+)?$ ]] || { echo "bundle.sh: --python takes a version such as 3.12" >&2; exit 2; }
[[ "$platform" =~ ^manylinux_2_([0-9]+)_x86_64$ ]] || {
  echo "bundle.sh: --platform takes manylinux_2_N_x86_64 (the redis-server part is Debian's amd64 build)" >&2; exit 2; }
glibc_minor=${BASH_REMATCH[1]}

log() { echo "[bundle] $*"; }
PY=.venv/bin/python
[ -x "$PY" ] || { echo "bundle.sh: no .venv here; run scripts/bootstrap.sh --dev first (the bundle pins what it installs)" >&2; exit 1; }

if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/MANIFEST" ]; then
  echo "bundle.sh: $dir is not empty and holds no bundle; refusing to write into it" >&2; exit 1
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
rm -rf "$dir/wheels" "$dir/redis" "$dir/MANIFEST"  # a wheel left from an older bundle would install two versions
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# pip accepts a wheel for the exact platform tags it is given: every manylinux tag a host with glibc
# 2.N runs, down to the legacy aliases (manylinux2014 = 2.17, manylinux2010 = 2.12, manylinux1 = 2.5).
platform_flags=()
for ((n = glibc_minor; n >= 5; n--)); do platform_flags+=(--platform "manylinux_2_${n}_x86_64"); done
((glibc_minor >= 17)) && platform_flags+=(--platform manylinux2014_x86_64)
((glibc_minor >= 12)) && platform_flags+=(--platform manylinux2010_x86_64)
platform_flags+=(--platform manylinux1_x86_64)

bundle_wheels() {
  "$PY" scripts/bundle_plan.py --python "$python" --machine x86_64 $all >"$work/plan"
  awk '$1 == "bundle" { print $2 "==" $3 }' "$work/plan" >"$work/requirements.txt"
  log "downloading $(wc -l <"$work/requirements.txt") wheels for CPython $python on $platform"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --implementation cp --python-version "$python" "${platform_flags[@]}" \
    -d "$dir/wheels" -r "$work/requirements.txt"
}

# Debian's apt lists, or a private copy where this machine has none for amd64.
apt_options=()
prepare_apt() {
  if [ "$(dpkg --print-architecture)" = amd64 ] && apt-cache show redis-tools >/dev/null 2>&1; then
    return
  fi
  apt_options=(-o APT::Architecture=amd64 -o APT::Architectures=amd64 -o "Dir::State::Lists=$work/apt-lists"
               -o "Dir::Cache=$work/apt-cache" -o Debug::NoLocking=1)
  mkdir -p "$work/apt-lists/partial" "$work/apt-cache/archives/partial"
  log "apt-get update into a private list (none for amd64 here)"
  apt-get "${apt_options[@]}" update -qq
}

# redis-tools (which holds Debian's redis-server binary) and the library packages it depends on, transitively.
redis_packages() {
  local pending=(redis-tools) seen=" " package dependency
  while [ ${#pending[@]} -gt 0 ]; do
    package=${pending[0]}; pending=("${pending[@]:1}")
    case "$seen" in *" $package "*) continue ;; esac
    seen+="$package "
    echo "$package"
    for dependency in $(apt-cache "${apt_options[@]}" depends --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances "$package" | awk '$1 ~ /Depends:$/ && $2 ~ /^lib/ { print $2 }'); do
      pending+=("$dependency")
    done
  done
}

# The server runs under the dynamic loader of the glibc it was built with, over a folder of exactly
# the libraries it loads: it needs nothing of the host's (an older glibc there would refuse it).
bundle_redis() {
  prepare_apt
  mkdir -p "$work/debs" "$work/root"
  mapfile -t packages < <(redis_packages)
  log "apt-get download ${packages[*]}"
  # As root, apt warns that it downloads unsandboxed: that is the only output kept quiet.
  if ! (cd "$work/debs" && apt-get "${apt_options[@]}" download -qq "${packages[@]}") >"$work/apt.log" 2>&1; then
    cat "$work/apt.log" >&2; echo "bundle.sh: apt-get download failed" >&2; exit 1
  fi
  for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
  local root=$work/root triplet=x86_64-linux-gnu loader=ld-linux-x86-64.so.2
  local libs="$root/lib/$triplet:$root/usr/lib/$triplet"
  mkdir -p "$dir/redis/bin" "$dir/redis/libexec" "$dir/redis/lib"
  # Named redis-server: Debian's server is redis-check-rdb, and redis picks its mode from argv[0].
  cp "$root/usr/bin/redis-check-rdb" "$dir/redis/libexec/redis-server"
  cp "$root/usr/bin/redis-cli" "$dir/redis/libexec/redis-cli"
  cp -L "$root/lib/$triplet/$loader" "$dir/redis/lib/$loader"
  local binary line
  for binary in redis-server redis-cli; do
    "$dir/redis/lib/$loader" --library-path "$libs" --list "$dir/redis/libexec/$binary" >"$work/ldd"
    if grep -q "not found" "$work/ldd"; then cat "$work/ldd" >&2; echo "bundle.sh: a library of $binary is missing" >&2; exit 1; fi
    while read -r line; do
      [ "$line" -ef "$dir/redis/lib/$(basename "$line")" ] || cp -L "$line" "$dir/redis/lib/"
    done < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 }' "$work/ldd")
  done
  for binary in redis-server redis-cli; do
    cat >"$dir/redis/bin/$binary" <<EOF
#!/bin/sh
# Debian's $binary under its own glibc's loader and libraries (see scripts/bundle.sh); no other
# program is run, so it works with any PATH.
here="\${0%/*}/.."
exec "\$here/lib/$loader" --library-path "\$here/lib" "\$here/libexec/$binary" "\$@"
EOF
    chmod +x "$dir/redis/bin/$binary"
  done
  dpkg-deb -f "$work"/debs/redis-tools_*.deb Version >"$work/redis-version"
  for deb in "$work"/debs/*.deb; do
    echo "deb $(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version) $(sha256sum "$deb" | cut -d' ' -f1)"
  done >"$work/debs.txt"
  "$dir/redis/bin/redis-server" --version >"$work/redis-server-version"
}

write_manifest() {
  {
    echo "# MILI offline bundle, written by scripts/bundle.sh at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# from commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "# Install: scripts/bootstrap.sh --offline DIR. Lines: python, platform, wheel NAME VERSION FILE SHA256,"
    echo "# host NAME VERSION (the host's own; VERSION is the one tested), deb PACKAGE VERSION SHA256, file PATH SHA256."
    echo "python $python"
    echo "platform $platform"
    echo "redis-server $(awk '{ print $3 }' "$work/redis-server-version" | sed 's/^v=//') (Debian redis-tools $(cat "$work/redis-version"))"
    local name version file
    while read -r kind name version; do
      [ "$kind" = bundle ] || continue
      file=$(cd "$dir/wheels" && ls | grep -i "^$(echo "$name" | sed 's/-/[-_.]/g')-$version-" | head -n1)
      [ -n "$file" ] || { echo "bundle.sh: no wheel of $name $version was downloaded" >&2; exit 1; }
      echo "wheel $name $version $file $(sha256sum "$dir/wheels/$file" | cut -d' ' -f1)"
    done <"$work/plan"
    awk '$1 == "host" { print "host", $2, $3 }' "$work/plan"
    cat "$work/debs.txt"
    (cd "$dir" && find redis -type f | sort | xargs sha256sum | awk '{ print "file", $2, $1 }')
  } >"$dir/MANIFEST"
}

bundle_wheels
bundle_redis
write_manifest
bytes=$(du -sb "$dir" | cut -f1)
log "redis-server: $(head -c 200 "$work/redis-server-version")"
log "$(grep -c '^wheel ' "$dir/MANIFEST") wheels, redis-server and $(ls "$dir/redis/lib" | wc -l) libraries in $dir"
log "size: $((bytes / 1024 / 1024)) MiB ($bytes bytes); a device run carries at most 64 MiB with the working tree"
