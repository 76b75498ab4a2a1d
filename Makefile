# walbox: the two commands that matter are `make demo` and `make test`.
# Both install what they need first (see scripts/deps.sh).

CARGO ?= cargo
FUZZ_SECONDS ?= 60
export CARGO_TERM_COLOR ?= never

.PHONY: all build release deps demo test test-vendor test-e2e test-matrix test-conformance fmt-check clippy bench bench-decoder bench-relay flamegraphs fuzz clean

# PostgreSQL majors the end-to-end tests run on: `make test` runs the whole suite on
# the first and the end-to-end tests again on the others; `make test-matrix` runs
# the whole suite on every supported major. 15 is Debian's; 16, 17 and 18 are
# fetched once per machine by scripts/pg-major.sh.
PG_VERSIONS ?= 15 17
PG_MATRIX ?= 15 16 17 18

all: build

build:
	$(CARGO) build --workspace --release

# One release build serves `make release`, `make demo` and `make bench` (and
# `make flamegraphs`): the same packages, so the same features unify and going
# from one target to another compiles nothing. tests/deploy.rs checks that each
# of them runs this very command.
RELEASE_BUILD = $(CARGO) build --release --locked -p walbox -p walbox-testkit -p walbox-bench --bins

## The walbox binary (target/release/walbox), as the Dockerfile builds it, with
## the demo and the benchmark beside it.
release:
	$(RELEASE_BUILD)

deps:
	@scripts/deps.sh $(PG_VERSIONS)

## The main job end to end on throwaway infrastructure.
demo: deps
	$(RELEASE_BUILD)
	./target/release/walbox-demo --walbox ./target/release/walbox --sink $(or $(SINK),kafka)

# Test binaries run side by side (scripts/run-tests.py): each starts its own
# servers on free ports and spends most of its time waiting on them. Within a
# binary, tests run as threads of one process and may share a server.
TEST_JOBS ?= 3
# The conformance suite's cells wait on their servers most of the time: four
# at once.
RUN_TESTS = scripts/run-tests.py -j $(TEST_JOBS) --threads conformance=4 --threads front_door=4

## Everything CI checks: formatting, lints, unit, property and end-to-end tests
## (the conformance suite in its short profile among them).
test: deps fmt-check clippy
	WALBOX_PG_VERSION=$(firstword $(PG_VERSIONS)) $(RUN_TESTS) -- --workspace --all-targets
	$(CARGO) test --workspace --doc
	$(MAKE) --no-print-directory test-vendor
	@for v in $(wordlist 2,99,$(PG_VERSIONS)); do \
	  $(MAKE) --no-print-directory test-e2e PG_VERSION=$$v E2E_SKIP="$(DESTINATION_TESTS)" || exit 1; \
	done

## The unit tests of the pgwire-replication copy walbox carries (outside the
## workspace, with its own lock file).
test-vendor:
	$(CARGO) test --locked --manifest-path vendor/pgwire-replication/Cargo.toml --lib

## The end-to-end tests (the ones that start PostgreSQL) on one major: PG_VERSION=17.
## E2E_SKIP leaves out test files by name: `make test` runs the ones about a
## destination or a file (DESTINATION_TESTS), not about the server, on the first
## major only.
PG_VERSION ?= 15
E2E_SKIP ?=
DESTINATION_TESTS = nats nats_records nats_link formats kafka_security deploy rabbitmq redis webhook pubsub kinesis sqs sns conformance front_door
E2E_TESTS = $(filter-out $(E2E_SKIP),$(basename $(notdir $(wildcard tests/*.rs crates/walbox-pgoutput/tests/*.rs))))
test-e2e:
	@echo "== end-to-end tests on PostgreSQL $(PG_VERSION)$(if $(E2E_SKIP), (not: $(E2E_SKIP)))"
	WALBOX_PG_VERSION=$(PG_VERSION) $(RUN_TESTS) -- -p walbox -p walbox-pgoutput $(foreach t,$(E2E_TESTS),--test $(t))

## The conformance suite in full: every history in every envelope format, with
## more kill rounds (`make test` runs its short profile).
test-conformance: deps
	WALBOX_CONFORMANCE=full RUST_TEST_THREADS=4 $(CARGO) test -p walbox --test conformance --no-fail-fast

## The whole suite on every supported major.
test-matrix: fmt-check clippy
	@scripts/deps.sh $(PG_MATRIX)
	@for v in $(PG_MATRIX); do \
	  echo "== whole suite on PostgreSQL $$v"; \
	  WALBOX_PG_VERSION=$$v $(RUN_TESTS) -- --workspace --all-targets || exit 1; \
	done

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## Benchmarks print their figures and the setup they ran on.
BENCH_EVENTS ?= 1000000
BENCH_BIG_TXN ?= 1000000
BENCH_STEADY_SECONDS ?= 60
# Rounds of the slot contenders (rotating order; median and spread reported).
BENCH_REPEAT ?= 3
BENCH_ARGS ?=
bench: bench-decoder bench-relay

bench-relay: deps
	$(RELEASE_BUILD)
	./target/release/walbox-bench --events $(BENCH_EVENTS) --big-txn $(BENCH_BIG_TXN) --repeat $(BENCH_REPEAT) --steady-seconds $(BENCH_STEADY_SECONDS) --svg-dir docs --walbox ./target/release/walbox $(BENCH_ARGS)

## Flame graphs of rows and messages to the broker and of rows to JetStream and
## to Redis Streams (docs/flame-*.svg), with perf and inferno.
flamegraphs: deps
	$(RELEASE_BUILD)
	scripts/flamegraphs.sh docs

bench-decoder:
	$(CARGO) bench -p walbox-pgoutput --bench decode

## Coverage-guided fuzzing of the pgoutput decoder (installs cargo-fuzz once).
## cargo-fuzz needs nightly-only compiler flags; RUSTC_BOOTSTRAP allows them on
## the stable toolchain.
fuzz:
	@command -v cargo-fuzz >/dev/null 2>&1 || $(CARGO) install cargo-fuzz --locked
	cd crates/walbox-pgoutput && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run decode -- -max_total_time=$(FUZZ_SECONDS)

clean:
	$(CARGO) clean
