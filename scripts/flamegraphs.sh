#!/usr/bin/env bash
# Flame graphs of walbox on its busiest paths, as committed in docs/: rows to
# the broker, [[messages]] to the broker, rows to JetStream and rows to Redis
# Streams.
#
#   scripts/flamegraphs.sh [OUT_DIR] [EVENTS]     (default: docs 300000)
#
# FLAMES="flame-redis" (names as below, space-separated) draws some of them
# only, and runs only the contenders they need.
#
# Runs walbox-bench (--only backlog,messages, one round) with a wrapper as its
# walbox: the walbox process of each path, found by its slot, runs under
# `perf record` (DWARF call graphs, 1999 Hz), so that every thread it starts is
# sampled (the sink's client threads too); `inferno` folds and renders the
# samples as SVG. Needs the release build of walbox and walbox-bench (`make
# bench` builds them; they are looked for in $CARGO_TARGET_DIR/release,
# target/release by default), Linux perf (Debian's linux-perf, installed here
# if missing) and inferno (installed with cargo if missing). Root, or
# kernel.perf_event_paranoid <= 1. Functions narrower than a pixel are left
# out (--minwidth 1).
set -euo pipefail

out=${1:-docs}
events=${2:-300000}
here=$(cd "$(dirname "$0")/.." && pwd)
release="${CARGO_TARGET_DIR:-$here/target}/release"
bench="$release/walbox-bench"
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

if ! command -v perf >/dev/null 2>&1; then
  apt-get install -y --no-install-recommends linux-perf >/dev/null
fi
if ! command -v inferno-flamegraph >/dev/null 2>&1; then
  cargo install inferno --locked --version 0.12.8
fi
[ -x "$bench" ] || cargo build --release -p walbox -p walbox-bench

# name, slot (round 1 of the bench's contenders), the contender's short name
# (the messages scenario's runs all of its own), title
all_paths=(
  "flame-rows-kafka walbox_kafka_r1 walbox-broker walbox: outbox rows to the broker"
  "flame-messages-kafka walbox_kafka_messages_r1 - walbox: [[messages]] to the broker"
  "flame-jetstream walbox_nats_r1 walbox-jetstream walbox: outbox rows to JetStream"
  "flame-redis walbox_redis_r1 walbox-redis walbox: outbox rows to Redis Streams"
  "flame-rabbitmq-exchange walbox_rabbitmq_exchange_r1 walbox-rabbitmq-exchange walbox: outbox rows to a RabbitMQ exchange, confirmed"
)
paths=()
scenarios=()
contenders=()
for p in "${all_paths[@]}"; do
  read -r name _ short _ <<<"$p"
  if [ -n "${FLAMES:-}" ] && ! [[ " $FLAMES " == *" $name "* ]]; then continue; fi
  paths+=("$p")
  if [ "$short" = - ]; then
    scenarios+=(messages)
  else
    scenarios+=(backlog)
    contenders+=("$short")
  fi
done
[ ${#paths[@]} -gt 0 ] || { echo "FLAMES names none of the graphs" >&2; exit 1; }
only=$(printf '%s\n' "${scenarios[@]}" | sort -u | paste -sd, -)
picked=()
[ ${#contenders[@]} -gt 0 ] && picked=(--contenders "$(IFS=,; echo "${contenders[*]}")")

# The walbox the bench runs: under perf for the slots above, as it is for
# the others.
{
  echo '#!/usr/bin/env bash'
  for p in "${paths[@]}"; do
    read -r name slot _ <<<"$p"
    echo "[ \"\${WALBOX_SLOT:-}\" = $slot ] && exec perf record -q -F 1999 --call-graph dwarf,16384 -o $work/$name.data -- $release/walbox \"\$@\""
  done
  echo "exec $release/walbox \"\$@\""
} >"$work/walbox"
chmod +x "$work/walbox"

"$bench" --only "$only" "${picked[@]}" --events "$events" --repeat 1 --walbox "$work/walbox" >"$work/bench.txt"

mkdir -p "$out"
for p in "${paths[@]}"; do
  read -r name slot _ title <<<"$p"
  [ -s "$work/$name.data" ] || { echo "no samples for $slot" >&2; exit 1; }
  perf script -i "$work/$name.data" 2>/dev/null | inferno-collapse-perf >"$work/$name.folded"
  # FOLDED_DIR keeps the folded stacks, for reading the figures behind a graph.
  [ -n "${FOLDED_DIR:-}" ] && cp "$work/$name.folded" "$FOLDED_DIR/"
  inferno-flamegraph --title "$title ($events events)" --width 1600 --minwidth 1 \
    <"$work/$name.folded" >"$out/$name.svg"
  echo "$out/$name.svg"
done
