# Redis from Debian's package, for where Docker Hub's `redis` image cannot be pulled (bench/compose_smoke.sh: no image
# registry reachable). Debian bookworm ships Redis 7.0; the stack's own image is redis:8.2-alpine. The farm uses
# lists, hashes, sorted sets and Lua, all in 7.0.
#   docker build --network host -f deploy/local/redis.Dockerfile --build-arg BASE_IMAGE=<a bookworm image> -t NAME .
ARG BASE_IMAGE=debian:bookworm-slim
# hadolint ignore=DL3006
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data \
 && chown redis:redis /data
# hadolint ignore=DL3066
USER redis
WORKDIR /data
CMD ["redis-server", "--appendonly", "yes"]
