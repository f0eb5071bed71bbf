#!/usr/bin/env bash
# End to end on a real Docker engine: build both images, run docker-compose.yml's `cpu` and
# `postgres` profiles, kill the trainer container mid-run and check that its ranks re-form the
# job in a new epoch, check the audit chain with `rngcoord verify` inside each coordinator, then
# tear everything down, volumes included (also on failure).
#
#   sudo scripts/compose_e2e.sh          # .ci/run runs it when it can start a Docker engine
#
# No image registry is needed. The base of every image is Debian bookworm made by debootstrap
# (kept as rngcoord-base:bookworm and reused while it exists; the other builds rely on the
# build cache); the PostgreSQL image is that base plus Debian's
# postgresql, with a small entry point that honours the variables of the official image which
# docker-compose.yml sets. Python packages come from the package index, reached from the builds
# over the host's network. Optional, for a sandbox:
#   E2E_CA_BUNDLE   CA bundle for pip inside the builds (default: $PIP_CERT), as a build secret
#   E2E_WHEELS_DIR  a directory of wheels for the trainer's pip --find-links, e.g. a CPU torch
#                   (default: $PIP_FIND_LINKS when that is a directory)
#   E2E_STEPS       training steps per run (default 100); the kill comes at step E2E_KILL_AT (20)
# Everything listens on 127.0.0.1 (host networking) on ports 29620-29623 and 55432.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=rngcoord-base:bookworm
WHEELS_IMAGE=rngcoord-e2e-wheels:local
export COMPOSE_PROJECT_NAME=rngcoord-e2e
export POSTGRES_IMAGE=rngcoord-postgres:bookworm
export LISTEN_ADDR=127.0.0.1 COORDINATOR_PORT=29620 METRICS_PORT=29621
export COORDINATOR_PG_PORT=29622 METRICS_PG_PORT=29623 POSTGRES_PORT=55432
export CPU_RANKS=4 TRAIN_STEPS="${E2E_STEPS:-100}" TRAIN_ARGS="--checkpoint-every=25"
KILL_AT="${E2E_KILL_AT:-20}"
CA_BUNDLE="${E2E_CA_BUNDLE-${PIP_CERT:-}}"
WHEELS_DIR="${E2E_WHEELS_DIR-${PIP_FIND_LINKS:-}}"
[ -d "$WHEELS_DIR" ] || WHEELS_DIR=""

START=$SECONDS
STEP_START=$SECONDS
log() { printf '[e2e %4ds] %s\n' "$((SECONDS - START))" "$*"; }
step() {
  STEP_START=$SECONDS
  log "== step $1"
}
step_done() { log "   done in $((SECONDS - STEP_START))s"; }
fail() {
  log "FAIL: $*"
  exit 1
}

if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
else
  COMPOSE=(docker-compose)
fi
PROFILES=(--profile cpu --profile postgres)
compose() { "${COMPOSE[@]}" --file docker-compose.yml "$@"; }

# The builds mount a secret and a stage, which needs BuildKit: either the buildx plugin or a
# docker CLI from before 23.0, which has BuildKit built in behind DOCKER_BUILDKIT=1.
BUILD=()
for cli in $(type -ap docker); do
  if "$cli" buildx version >/dev/null 2>&1; then
    BUILD=("$cli" buildx build --load)
    break
  elif DOCKER_BUILDKIT=1 "$cli" build --help 2>/dev/null | grep -q -- '--secret'; then
    BUILD=(env DOCKER_BUILDKIT=1 "$cli" build)
    break
  fi
done
[ ${#BUILD[@]} -gt 0 ] || fail "no docker CLI here builds with BuildKit (install docker-buildx)"

teardown() {
  local rc=$?
  trap - EXIT
  step "7/7 teardown: containers, networks and volumes"
  compose "${PROFILES[@]}" down --volumes --remove-orphans --timeout 30 2>&1 | sed 's/^/    /'
  step_done
  if [ "$rc" = 0 ]; then
    log "PASS: end to end in $((SECONDS - START))s"
  else
    log "FAILED (exit $rc) after $((SECONDS - START))s"
  fi
  exit "$rc"
}
trap teardown EXIT

container_of() { compose "${PROFILES[@]}" ps -q "$1"; }

wait_healthy() {
  local service=$1 deadline=$((SECONDS + 120)) id status
  id=$(container_of "$service")
  [ -n "$id" ] || fail "no container for $service"
  while :; do
    status=$(docker inspect -f '{{.State.Health.Status}}' "$id")
    [ "$status" = healthy ] && break
    if [ "$SECONDS" -ge "$deadline" ]; then
      docker logs --tail 30 "$id" 2>&1 | sed 's/^/    /'
      fail "$service is $status after 120s"
    fi
    sleep 2
  done
  log "   $service: healthy (Docker's health status, from its HEALTHCHECK)"
}

# wait_log ID PATTERN SECONDS: until the container's log (all its runs) has a line matching.
wait_log() {
  local id=$1 pattern=$2 deadline=$((SECONDS + $3))
  until docker logs "$id" 2>&1 | grep -q -E "$pattern"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      docker logs --tail 40 "$id" 2>&1 | sed 's/^/    /'
      fail "no line matching /$pattern/ within $3s"
    fi
    sleep 1
  done
  docker logs "$id" 2>&1 | grep -E "$pattern" | tail -n 1 | sed 's/^/    /'
}

# start_trainer JOB ADDR: (re)creates the CPU trainer for JOB against the coordinator at ADDR.
start_trainer() {
  RNGCOORD_JOB=$1 RNGCOORD_ADDR=$2 compose --profile cpu up -d --no-build trainer-cpu 2>&1 |
    sed 's/^/    /'
}

# kill_trainer_and_reform JOB: kills the trainer container (SIGKILL to its init, as a crash or
# an OOM kill would; `docker kill` counts as a manual stop, which no restart policy answers)
# mid-run, then waits for the restarted ranks to join epoch 2 and the run to finish cleanly.
kill_trainer_and_reform() {
  local job=$1 id deadline state
  id=$(container_of trainer-cpu)
  [ -n "$id" ] || fail "no trainer-cpu container"
  log "   trainer $job: waiting for 4 ranks in epoch 1 and step $KILL_AT"
  wait_log "$id" "ranks joined group .* of job '$job' in epoch 1" 180
  wait_log "$id" "step $KILL_AT/$TRAIN_STEPS .* epoch 1" 180
  log "   killing the trainer container mid-run (SIGKILL to its init, pid $(docker inspect -f '{{.State.Pid}}' "$id"))"
  kill -KILL "$(docker inspect -f '{{.State.Pid}}' "$id")"
  log "   waiting for Docker to restart it and its ranks to re-form the job"
  wait_log "$id" "ranks joined group .* of job '$job' in epoch 2" 180
  deadline=$((SECONDS + 300))
  while :; do
    state=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}' "$id")
    case $state in
      "exited 0 "*) break ;;
      exited*) docker logs --tail 40 "$id" 2>&1 | sed 's/^/    /'; fail "trainer ended: $state" ;;
    esac
    [ "$SECONDS" -lt "$deadline" ] || fail "trainer still running after 300s: $state"
    sleep 2
  done
  docker logs "$id" 2>&1 | grep -E "step $TRAIN_STEPS/|\] done" | tail -n 2 | sed 's/^/    /'
  log "   trainer $job finished (status, exit code, restarts: $state)"
}

build_postgres_image() {
  local ctx
  ctx=$(mktemp -d)
  cat >"$ctx/Dockerfile" <<'EOF'
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
# No cluster from the package's post-install: the entry point creates the one in PGDATA.
RUN mkdir -p /etc/postgresql-common/createcluster.d \
 && echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.d/no-main.conf \
 && apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:${PATH} PGDATA=/var/lib/postgresql/data
COPY entrypoint.sh /usr/local/bin/entrypoint.sh
RUN mkdir -p "$PGDATA" && chown postgres:postgres "$PGDATA" && chmod 700 "$PGDATA"
USER postgres
VOLUME ["/var/lib/postgresql/data"]
ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
CMD ["postgres"]
EOF
  cat >"$ctx/entrypoint.sh" <<'EOF'
#!/bin/sh
# The official image's first start, for the variables docker-compose.yml sets: a cluster whose
# superuser is POSTGRES_USER with POSTGRES_PASSWORD (scram), and the database POSTGRES_DB.
set -eu
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  # UTF8 as the official image has it: under SQL_ASCII, psycopg would read text back as bytes.
  initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
  echo "CREATE DATABASE \"$POSTGRES_DB\"" | postgres --single postgres >/dev/null
fi
exec "$@"
EOF
  chmod +x "$ctx/entrypoint.sh"
  build_image "$POSTGRES_IMAGE" --network host --build-arg BASE_IMAGE="$BASE_IMAGE" "$ctx"
  rm -rf "$ctx"
}

# build_image TAG ARGS...: a BuildKit build whose log is shown only when it fails.
build_image() {
  local tag=$1 out
  shift
  out=$(mktemp)
  if ! "${BUILD[@]}" --progress=plain --tag "$tag" "$@" >"$out" 2>&1; then
    tail -n 40 "$out" | sed 's/^/    /'
    rm -f "$out"
    fail "building $tag"
  fi
  rm -f "$out"
}

# verify SERVICE JOB: the coordinator's own records show JOB's two epochs, and `rngcoord verify`
# in its container finds the audit chain intact and no grants overlapping.
verify() {
  local service=$1 job=$2 epochs
  compose "${PROFILES[@]}" exec -T "$service" rngcoord audit --job "$job" --kind epoch |
    sed 's/^/    /'
  epochs=$(compose "${PROFILES[@]}" exec -T "$service" rngcoord audit --job "$job" --kind epoch --json | grep -c .)
  [ "$epochs" = 2 ] || fail "$service recorded $epochs epochs of $job, expected 2"
  compose "${PROFILES[@]}" exec -T "$service" rngcoord verify | sed 's/^/    /'
}

image_mb() { docker image inspect -f '{{.Size}}' "$1" | awk '{printf "%d MB", $1 / 1000000}'; }

step "1/7 images"
log "   building with: ${BUILD[*]}"
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "   $BASE_IMAGE: cached"
else
  rootfs=$(mktemp -d)
  log "   debootstrap bookworm (minbase + python3, python3-venv, ca-certificates)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" >/dev/null
  tar -C "$rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  log "   $BASE_IMAGE: built ($((SECONDS - STEP_START))s)"
fi
common=(--network host --build-arg BASE_IMAGE="$BASE_IMAGE")
if [ -n "$CA_BUNDLE" ]; then
  common+=(--build-arg PIP_CERT=/run/secrets/pip_cert --secret "id=pip_cert,src=$CA_BUNDLE")
  log "   pip inside the builds trusts $CA_BUNDLE (a build secret, in no layer)"
fi
trainer_args=()
if [ -n "$WHEELS_DIR" ]; then
  if ! docker image inspect "$WHEELS_IMAGE" >/dev/null 2>&1; then
    tar -C "$WHEELS_DIR" -c . | docker import - "$WHEELS_IMAGE" >/dev/null
  fi
  trainer_args+=(--build-arg WHEELS_IMAGE="$WHEELS_IMAGE")
  log "   the trainer's pip also finds the wheels of $WHEELS_DIR (mounted, in no layer)"
fi
t=$SECONDS
build_image rngcoord-coordinator:local "${common[@]}" -f Dockerfile.coordinator .
log "   rngcoord-coordinator:local built in $((SECONDS - t))s: $(image_mb rngcoord-coordinator:local)"
t=$SECONDS
build_image rngcoord-trainer:local "${common[@]}" "${trainer_args[@]}" -f Dockerfile.trainer .
log "   rngcoord-trainer:local built in $((SECONDS - t))s: $(image_mb rngcoord-trainer:local)"
t=$SECONDS
build_postgres_image
log "   $POSTGRES_IMAGE built in $((SECONDS - t))s: $(image_mb "$POSTGRES_IMAGE")"
log "   base image: $(image_mb "$BASE_IMAGE")"
log "   coordinator image: $(docker image inspect -f 'user={{.Config.User}} torch label="{{index .Config.Labels "io.rngcoord.torch"}}"' rngcoord-coordinator:local)"
if no_torch=$(docker run --rm --network none --entrypoint python rngcoord-coordinator:local \
  -c 'import torch' 2>&1); then
  fail "the coordinator image imports torch"
fi
log "   coordinator image: import torch -> $(tail -n 1 <<<"$no_torch")"
log "   coordinator image runs as uid $(docker run --rm --network none --entrypoint id rngcoord-coordinator:local -u)"
step_done

step "2/7 up: the cpu profile (coordinator on SQLite + a 4-rank CPU trainer)"
start_trainer tp-cpu "127.0.0.1:$COORDINATOR_PORT"
step_done

step "3/7 health: the coordinator's HEALTHCHECK"
wait_healthy coordinator
step_done

step "4/7 kill the trainer container mid-run; the job re-forms in a new epoch"
kill_trainer_and_reform tp-cpu
step_done

step "5/7 rngcoord verify inside the coordinator container"
verify coordinator tp-cpu
step_done

step "6/7 the postgres profile: PostgreSQL on :$POSTGRES_PORT, coordinator-pg, the same trainer run"
compose "${PROFILES[@]}" up -d --no-build postgres coordinator-pg 2>&1 | sed 's/^/    /'
wait_healthy postgres
wait_healthy coordinator-pg
start_trainer tp-pg "127.0.0.1:$COORDINATOR_PG_PORT"
kill_trainer_and_reform tp-pg
log "   rngcoord verify inside coordinator-pg"
verify coordinator-pg tp-pg
step_done
