# Prometheus from Debian's package, for where Docker Hub's `prom/prometheus` cannot be pulled (bench/compose_smoke.sh:
# no image registry reachable). Debian bookworm ships Prometheus 2.42; the stack's own image is prom/prometheus:v3.5.0.
# wget for the health check, as the official image's busybox has it.
#   docker build --network host -f deploy/local/prometheus.Dockerfile --build-arg BASE_IMAGE=<a bookworm image> -t NAME .
ARG BASE_IMAGE=debian:bookworm-slim
# hadolint ignore=DL3006
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus /etc/prometheus \
 && chown prometheus:prometheus /prometheus
# hadolint ignore=DL3066
USER prometheus
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
