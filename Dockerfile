# walbox in a container: the binary built the way `make release` builds it, on
# Debian bookworm, in a small runtime image that runs as a non-root user.
#
#   docker build -t walbox .
#   docker run -v walbox-state:/var/lib/walbox -e WALBOX_DSN=... \
#     -e WALBOX_BOOTSTRAP_SERVERS=kafka:9092 -p 9187:9187 walbox run
#
# The checkpoint is written to the working directory, /var/lib/walbox, a volume:
# keep it across container restarts and upgrades.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The build tools of scripts/deps.sh (librdkafka's bundled C build), then the
# release binary exactly as `make release` builds it (the one release build of
# `make demo` and `make bench` too; only walbox goes into the image).
RUN scripts/deps.sh --build-only && rm -rf /var/lib/apt/lists/*
RUN make release

FROM debian:bookworm-slim
# librdkafka is linked statically; OpenSSL (Kafka TLS and SASL) and zlib are not.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3 zlib1g \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 walbox \
    && useradd --system --uid 10001 --gid walbox --home-dir /var/lib/walbox --no-create-home walbox \
    && install -d -o walbox -g walbox -m 0700 /var/lib/walbox \
    && install -d -m 0755 /etc/walbox
COPY --from=build /src/target/release/walbox /usr/local/bin/walbox
USER 10001:10001
WORKDIR /var/lib/walbox
VOLUME ["/var/lib/walbox"]
ENV WALBOX_METRICS_LISTEN=0.0.0.0:9187 \
    WALBOX_LOG_FORMAT=json
EXPOSE 9187
ENTRYPOINT ["/usr/local/bin/walbox"]
CMD ["run"]
