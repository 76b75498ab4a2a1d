# walbox: the two commands that matter are `make demo` and `make test`.
# Both install what they need first (see scripts/deps.sh).

CARGO ?= cargo
FUZZ_SECONDS ?= 60
export CARGO_TERM_COLOR ?= never

.PHONY: all build release deps demo test fmt-check clippy bench bench-decoder bench-relay fuzz clean

all: build

build:
	$(CARGO) build --workspace --release

## The walbox binary alone, as the Dockerfile builds it (target/release/walbox).
release:
	$(CARGO) build --release --locked -p walbox

deps:
	@scripts/deps.sh

## The main job end to end on throwaway infrastructure.
demo: deps
	$(CARGO) build --release -p walbox -p walbox-testkit --bins
	./target/release/walbox-demo --walbox ./target/release/walbox

## Everything CI checks: formatting, lints, unit, property and end-to-end tests.
test: deps fmt-check clippy
	$(CARGO) test --workspace --all-targets --no-fail-fast
	$(CARGO) test --workspace --doc

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
	$(CARGO) build --release -p walbox -p walbox-bench
	./target/release/walbox-bench --events $(BENCH_EVENTS) --big-txn $(BENCH_BIG_TXN) --repeat $(BENCH_REPEAT) --steady-seconds $(BENCH_STEADY_SECONDS) --svg-dir docs --walbox ./target/release/walbox $(BENCH_ARGS)

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
