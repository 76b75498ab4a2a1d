#!/usr/bin/env bash
# Installs what walbox's tests, demo and benchmarks need on a fresh Debian machine,
# and does nothing when it is all present:
#   - PostgreSQL server binaries (initdb, postgres, pg_recvlogical)
#   - the C toolchain pieces librdkafka's bundled build uses (with OpenSSL, so
#     Kafka TLS and SASL work)
#   - the tansu Kafka-protocol broker, pinned
#   - nats-server (Debian's package), the JetStream server the NATS sink's tests run
#   - rabbitmq-server and redis-server (Debian's packages): the RabbitMQ and Redis
#     Streams sinks' tests start their own nodes; the packages' services are
#     disabled, never started
#   - promtool (Debian's prometheus package) and systemd-analyze (systemd), which
#     check the alert rules and the service file in deploy/
#   - Java (default-jre-headless) and Google's Pub/Sub emulator, which the Pub/Sub
#     sink's tests start; the emulator comes from Google's package
#     google-cloud-cli-pubsub-emulator, whose apt repository this script does not
#     reach: it is checked for, and its absence stops with what to install
#   - python3 with venv, in which tests/formats.rs installs the CloudEvents SDK
#     that parses walbox's CloudEvents records
#   - kinesalite and LocalStack, the Kinesis and SQS/SNS stand-ins of the
#     AWS sinks' tests (scripts/aws.sh, from npm and PyPI)
#   - the PostgreSQL majors given as arguments (`scripts/deps.sh 15 17`): 15 from
#     apt, 16/17/18 through scripts/pg-major.sh
# Run as root for the apt part (CI runs as root); the cargo part needs only cargo.
#
# `scripts/deps.sh --build-only` installs only what `make release` needs (the
# build tools); the Dockerfile's builder stage runs it.
set -euo pipefail

build_only=false
majors=()
for arg in "$@"; do
  case "$arg" in
    --build-only) build_only=true ;;
    1[5-9]) majors+=("$arg") ;;
    *) echo "deps: unknown argument ${arg}; use --build-only or PostgreSQL majors (15 16 17 18)" >&2; exit 2 ;;
  esac
done

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
$build_only || have_pg_server || apt_packages+=(postgresql-15)
command -v make >/dev/null 2>&1 || apt_packages+=(make)
command -v cc >/dev/null 2>&1 || apt_packages+=(gcc)
command -v c++ >/dev/null 2>&1 || apt_packages+=(g++)
command -v pkg-config >/dev/null 2>&1 || apt_packages+=(pkg-config)
command -v perl >/dev/null 2>&1 || apt_packages+=(perl)
[ -e /usr/include/zlib.h ] || apt_packages+=(zlib1g-dev)
[ -e /usr/include/openssl/ssl.h ] || apt_packages+=(libssl-dev)
if ! $build_only; then
  command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)
  command -v prometheus >/dev/null 2>&1 || apt_packages+=(prometheus)
  command -v systemd-analyze >/dev/null 2>&1 || apt_packages+=(systemd)
  command -v python3 >/dev/null 2>&1 || apt_packages+=(python3)
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || apt_packages+=(python3-venv)
  command -v nats-server >/dev/null 2>&1 || apt_packages+=(nats-server)
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || apt_packages+=(rabbitmq-server)
  command -v redis-server >/dev/null 2>&1 || apt_packages+=(redis-server)
  command -v java >/dev/null 2>&1 || apt_packages+=(default-jre-headless)
fi

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
  # Packages start their services on install unless policy-rc.d says no: the
  # tests start their own servers, on their own ports, as an unprivileged user.
  policy_added=false
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    policy_added=true
  fi
  apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
  if $policy_added; then rm -f /usr/sbin/policy-rc.d; fi
  if command -v systemctl >/dev/null 2>&1; then
    for unit in rabbitmq-server redis-server epmd.socket epmd.service; do
      systemctl disable "$unit" >/dev/null 2>&1 || true
    done
  fi
fi

if $build_only; then
  log "ready: build tools"
  exit 0
fi

pubsub_jar_dir=/usr/lib/google-cloud-sdk/platform/pubsub-emulator/lib
if [ -n "${WALBOX_PUBSUB_EMULATOR_JAR:-}" ]; then
  [ -f "$WALBOX_PUBSUB_EMULATOR_JAR" ] || {
    echo "deps: WALBOX_PUBSUB_EMULATOR_JAR=$WALBOX_PUBSUB_EMULATOR_JAR is not a file" >&2
    exit 1
  }
elif ! compgen -G "$pubsub_jar_dir/cloud-pubsub-emulator-*-all.jar" >/dev/null; then
  echo "deps: Google's Pub/Sub emulator is missing (no $pubsub_jar_dir/cloud-pubsub-emulator-*-all.jar)." >&2
  echo "deps: install the package google-cloud-cli-pubsub-emulator from Google's Cloud SDK apt" >&2
  echo "deps: repository (as the gcloud CLI install guide says for Debian), or point" >&2
  echo "deps: WALBOX_PUBSUB_EMULATOR_JAR at a cloud-pubsub-emulator-*-all.jar" >&2
  exit 1
fi

cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
tansu_bin=$(command -v tansu 2>/dev/null || echo "$cargo_bin/tansu")
if [ -x "$tansu_bin" ] && "$tansu_bin" --version 2>/dev/null | grep -q " $TANSU_VERSION"; then
  :
else
  log "installing tansu $TANSU_VERSION (takes several minutes once)"
  cargo install tansu --version "$TANSU_VERSION" --locked --features dynostore,libsql
fi

"$(dirname "$0")/aws.sh" >/dev/null

for major in "${majors[@]}"; do
  "$(dirname "$0")/pg-major.sh" "$major" >/dev/null
done

log "ready: postgres server${majors[*]:+ (majors: ${majors[*]})}, build tools, promtool, systemd-analyze, nats-server, rabbitmq-server, redis-server, java, the Pub/Sub emulator, tansu $TANSU_VERSION, kinesalite, localstack"
