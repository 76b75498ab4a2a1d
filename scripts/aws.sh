#!/usr/bin/env bash
# Makes the AWS stand-ins walbox's tests and demo run available, once per
# machine, in a cache outside the repository:
#   - kinesalite (npm, pinned): a Kinesis Data Streams server that keeps what
#     it acknowledged on disk (--path)
#   - LocalStack core (PyPI, pinned), for SQS and SNS, in a venv of a Python
#     3.12 or later (its code needs 3.12; pyenv's on this image, or one on
#     PATH); started without Docker by the test kit
# The cache must be readable by the unprivileged account the test kit runs
# servers as, so it lives under /var/cache when run as root (WALBOX_AWS_CACHE
# overrides); the test kit looks in the same place.
set -euo pipefail

KINESALITE_VERSION=3.3.3
LOCALSTACK_VERSION=2026.3.0
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

venv=$cache/localstack-$LOCALSTACK_VERSION
if [ ! -e "$venv/.complete" ]; then
  python=""
  for candidate in python3.13 python3.12 "$HOME"/.pyenv/versions/3.13*/bin/python /root/.pyenv/versions/3.13*/bin/python "$HOME"/.pyenv/versions/3.12*/bin/python /root/.pyenv/versions/3.12*/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      python=$(command -v "$candidate")
      break
    fi
  done
  if [ -z "$python" ]; then
    echo "aws: LocalStack needs Python 3.12 or later with venv; none was found (pyenv install 3.13, or apt-get install python3.12-venv)" >&2
    exit 1
  fi
  log "installing LocalStack $LOCALSTACK_VERSION into $venv (with $python; takes a few minutes once)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    "localstack-core[runtime]==$LOCALSTACK_VERSION" 'cbor2<6' 'pyopenssl==25.3.0' \
    'cryptography>=45.0.7,<47' service-identity >/dev/null
  chmod -R a+rX "$venv"
  touch "$venv/.complete"
fi
echo "$dir/node_modules/kinesalite/cli.js"
echo "$venv/bin/python"
