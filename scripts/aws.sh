#!/usr/bin/env bash
# Makes the AWS stand-ins walbox's tests and demo run available, once per
# machine, in a cache outside the repository:
#   - kinesalite (npm, pinned): a Kinesis Data Streams server that keeps what
#     it acknowledged on disk (--path)
# The cache must be readable by the unprivileged account the test kit runs
# servers as, so it lives under /var/cache when run as root (WALBOX_AWS_CACHE
# overrides); the test kit looks in the same place.
set -euo pipefail

KINESALITE_VERSION=3.3.3
log() { printf 'aws: %s\n' "$*" >&2; }

if [ -n "${WALBOX_AWS_CACHE:-}" ]; then
  cache=$WALBOX_AWS_CACHE
elif [ "$(id -u)" -eq 0 ]; then
  cache=/var/cache/walbox
else
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/walbox
fi

if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "aws: npm is needed for kinesalite; install it (apt-get install npm)" >&2
    exit 1
  fi
  log "installing npm"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
fi

dir=$cache/kinesalite-$KINESALITE_VERSION
if [ ! -e "$dir/.complete" ]; then
  log "installing kinesalite $KINESALITE_VERSION into $dir"
  rm -rf "$dir"
  mkdir -p "$dir"
  (cd "$dir" && npm install --silent --no-audit --no-fund --no-save "kinesalite@$KINESALITE_VERSION" >/dev/null)
  chmod -R a+rX "$dir"
  touch "$dir/.complete"
fi
echo "$dir/node_modules/kinesalite/cli.js"
