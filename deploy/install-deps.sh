#!/usr/bin/env bash
# deploy/install-deps.sh: installs, from Debian 12's packages, everything k3shard
# builds, tests and benchmarks with. It is a no-op when every package is present
# (dpkg-query first; apt-get only runs for what is missing), so `make deps` is
# cheap to call before every build. Needs root (or sudo) only when something is
# missing.
set -euo pipefail

PKGS=(
  build-essential pkg-config clang clang-format libclang-rt-14-dev
  libzmq3-dev libmsgpack-dev libhwloc-dev
  libvulkan-dev glslc mesa-vulkan-drivers vulkan-tools
  libpcre2-dev libjansson-dev libmicrohttpd-dev libedit-dev liburing-dev
  python3 python3-numpy
  iproute2 iptables procps psmisc strace fio curl tmux
  # make reliability: peak RSS (time), the disk rows (mkfs.ext4, filefrag, losetup)
  time e2fsprogs mount
  chromium
  ansible openssh-server tcpdump rsync
)
# Node.js + npm drive the browser tests and the tiktoken oracle; a machine that
# already has them (from NodeSource, say, whose nodejs conflicts with Debian's
# npm) keeps its own.
command -v npm >/dev/null 2>&1 || PKGS+=(nodejs npm)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# The API tests' client (tests/api: the openai npm package) and the web UI's
# browser driver (tests/web: playwright-core, which drives Debian's chromium
# above and downloads no browser), each pinned by its package-lock.json: npm
# ci only when node_modules is missing, so this stays cheap. Needs the npm
# registry the first time only.
api_client() {
  local root d
  root="$(cd "$(dirname "$0")/.." && pwd)"
  for d in tests/api tests/web; do
    [ -d "$root/$d/node_modules" ] && continue
    command -v npm >/dev/null 2>&1 || { echo "install-deps: npm missing: $d not installed"; return 0; }
    echo "install-deps: npm ci in $d"
    (cd "$root/$d" && npm ci --no-audit --no-fund --loglevel=error)
  done
}

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  api_client
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
api_client
echo "install-deps: done"
