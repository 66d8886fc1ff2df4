# syntax=docker/dockerfile:1
#
# Multi-stage build of the `switchboard` image: one binary that runs any role
# (`switchboard gateway|orchestrator|worker|migrate|dev`), plus the official runners.
#
#   docker build -t switchboard:local .
#   docker run --rm -p 8080:8080 switchboard:local          # embedded mode (`dev`)

# --- build ---------------------------------------------------------------------------------
FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# Cache mounts keep the registry and incremental artefacts between builds; the binaries are
# copied out of the cached target dir because cache mounts are not part of the image.
# Runner plugins are assembled under /out/runners: every manifest, and each runner's binary at
# the path its manifest names (`bin/<name>`, relative to the plugin directory).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p switchboard -p sb-runner-echo -p sb-runner-local-agent \
 && mkdir -p /out/bin \
 && cp target/release/switchboard /out/bin/switchboard \
 && for dir in runners/*/; do \
        name="$(basename "$dir")"; \
        mkdir -p "/out/runners/$name/bin"; \
        cp "$dir"/manifest.* "/out/runners/$name/"; \
    done \
 && cp target/release/echo /out/runners/echo/bin/echo \
 && cp target/release/local-agent /out/runners/local-agent/bin/local-agent

# --- runtime -------------------------------------------------------------------------------
FROM debian:bookworm-slim
# ca-certificates: TLS to Postgres/RabbitMQ/Redis/model providers. tini: PID 1 that forwards
# signals and reaps runner grandchildren that exit after their parent. python3: runners
# written in Python (docs/RUNNERS.md), started as `command = "/usr/bin/python3"`.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates tini python3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /app --no-create-home switchboard \
 && mkdir -p /app/data /var/lib/switchboard \
 && chown switchboard:switchboard /app/data /var/lib/switchboard
COPY --from=builder /out/bin/switchboard /usr/local/bin/switchboard
COPY --from=builder /out/runners /app/runners
# The Python runner SDK (standard library only, so no pip): importable by the system python3.
COPY sdk/python/src/switchboard_runner /usr/lib/python3/dist-packages/switchboard_runner
WORKDIR /app
USER switchboard
ENV SWITCHBOARD__WORKER__RUNNERS_DIRS=/app/runners \
    SWITCHBOARD__GATEWAY__HTTP_ADDR=0.0.0.0:8080
# 8080: the gateway's API (and its /metrics); 9090: /metrics of the other roles.
EXPOSE 8080 9090
ENTRYPOINT ["/usr/bin/tini", "--", "switchboard"]
CMD ["dev", "--data-dir", "/app/data"]
