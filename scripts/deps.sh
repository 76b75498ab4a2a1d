#!/usr/bin/env bash
# Installs what walbox's tests, demo and benchmarks need on a fresh Debian machine,
# and does nothing when it is all present:
#   - PostgreSQL server binaries (initdb, postgres, pg_recvlogical)
#   - the C toolchain pieces librdkafka's bundled build uses (with OpenSSL, so
#     Kafka TLS and SASL work)
#   - the tansu Kafka-protocol broker, pinned
#   - Prometheus, which the metrics tests scrape walbox with
# Run as root for the apt part (CI runs as root); the cargo part needs only cargo.
set -euo pipefail

TANSU_VERSION=0.6.0
log() { printf 'deps: %s\n' "$*"; }

have_pg_server() {
  local d
  if [ -n "${WALBOX_PG_BINDIR:-}" ] && [ -x "$WALBOX_PG_BINDIR/initdb" ]; then return 0; fi
  if command -v pg_config >/dev/null 2>&1; then
    d=$(pg_config --bindir 2>/dev/null || true)
    [ -n "$d" ] && [ -x "$d/initdb" ] && [ -x "$d/pg_recvlogical" ] && return 0
  fi
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && [ -x "$d/pg_recvlogical" ] && return 0
  done
  return 1
}

apt_packages=()
have_pg_server || apt_packages+=(postgresql-15)
command -v make >/dev/null 2>&1 || apt_packages+=(make)
command -v cc >/dev/null 2>&1 || apt_packages+=(gcc)
command -v c++ >/dev/null 2>&1 || apt_packages+=(g++)
command -v pkg-config >/dev/null 2>&1 || apt_packages+=(pkg-config)
command -v perl >/dev/null 2>&1 || apt_packages+=(perl)
[ -e /usr/include/zlib.h ] || apt_packages+=(zlib1g-dev)
[ -e /usr/include/openssl/ssl.h ] || apt_packages+=(libssl-dev)
command -v prometheus >/dev/null 2>&1 || apt_packages+=(prometheus)

if [ ${#apt_packages[@]} -gt 0 ]; then
  log "installing ${apt_packages[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "deps: need root to apt-get install ${apt_packages[*]}" >&2
    exit 1
  fi
  # The tests start their own clusters; keep Debian from creating and starting one.
  mkdir -p /etc/postgresql-common
  if [ ! -e /etc/postgresql-common/createcluster.conf ] ||
     ! grep -q '^create_main_cluster *= *false' /etc/postgresql-common/createcluster.conf; then
    echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
fi

cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
tansu_bin=$(command -v tansu 2>/dev/null || echo "$cargo_bin/tansu")
if [ -x "$tansu_bin" ] && "$tansu_bin" --version 2>/dev/null | grep -q " $TANSU_VERSION"; then
  :
else
  log "installing tansu $TANSU_VERSION (takes several minutes once)"
  cargo install tansu --version "$TANSU_VERSION" --locked --features dynostore,libsql
fi

log "ready: postgres server, build tools, tansu $TANSU_VERSION"
