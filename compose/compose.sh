#!/usr/bin/env bash
# What `make up` / `make down` run: checks first, then docker compose.
#
#   compose/compose.sh up PROFILE [compose up args...]   PROFILE: cpu gpu-offered gpu-enforced hetero ring
#   compose/compose.sh down [compose down args...]       every profile's containers; volumes kept
#   compose/compose.sh config PROFILE
#
# Extra compose files: FEDGPU_COMPOSE_FILES="compose/gpu-device-ids.yaml ..." (paths
# relative to the repository root).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROFILES="cpu gpu-offered gpu-enforced hetero ring"

die() { echo "$*" >&2; exit 2; }

command -v docker >/dev/null 2>&1 \
  || die "no docker CLI: install Docker Engine + Compose v2 (on Debian/Ubuntu: bash tests/e2e/setup_docker.sh)"
docker compose version >/dev/null 2>&1 \
  || die "no 'docker compose' (Compose v2 plugin): install it (bash tests/e2e/setup_docker.sh does, from PyPI)"

files=(-f "$ROOT/compose/compose.yaml")
for extra in ${FEDGPU_COMPOSE_FILES:-}; do files+=(-f "$ROOT/$extra"); done
all_profiles=()
for p in $PROFILES; do all_profiles+=(--profile "$p"); done

check_profile() {
  local profile=${1:-}
  [ -n "$profile" ] || die "no profile given: PROFILE=one of: $PROFILES"
  case " $PROFILES " in
    *" $profile "*) ;;
    *) die "unknown profile '$profile': PROFILE=one of: $PROFILES" ;;
  esac
}

check_engine() {
  docker info >/dev/null 2>&1 \
    || die "no Docker engine answers: start one (bash tests/e2e/setup_docker.sh installs and starts dockerd)"
}

check_images() {
  local image missing=()
  # The images as compose resolves them (compose/.env, then the environment).
  for image in $(docker compose "${files[@]}" --profile "$1" config --images | sort -u); do
    docker image inspect "$image" >/dev/null 2>&1 || missing+=("$image")
  done
  [ ${#missing[@]} -eq 0 ] \
    || die "image(s) ${missing[*]} not in the engine: run 'make images' (or 'make images OFFLINE=1' without a registry)"
}

# GPU profiles reserve devices with driver "nvidia": the engine hands that to the
# NVIDIA Container Toolkit's hook. Without it `up` fails late with "could not
# select device driver"; say so up front (local engines only: a remote engine's
# host cannot be checked from here).
check_gpu_host() {
  case "$1" in cpu|ring) return 0 ;; esac
  [ "${FEDGPU_SKIP_GPU_CHECK:-0}" = 1 ] && return 0
  case "${DOCKER_HOST:-unix://}" in unix://*) ;; *) return 0 ;; esac
  command -v nvidia-container-runtime-hook >/dev/null 2>&1 && return 0
  command -v nvidia-container-cli >/dev/null 2>&1 && return 0
  die "profile '$1' reserves NVIDIA GPUs, but the NVIDIA Container Toolkit is not installed on this host" \
      "(no nvidia-container-runtime-hook): install it, or use PROFILE=cpu" \
      "(FEDGPU_SKIP_GPU_CHECK=1 skips this check)"
}

# The aggregator as the default saved connection "compose": `fedgpu status` then needs no
# --address or TLS options. The deployment is up either way; a CLI that cannot save it says why.
save_connection() {
  local fedgpu
  if [ -x "$ROOT/.venv/bin/fedgpu" ]; then fedgpu="$ROOT/.venv/bin/fedgpu"
  elif command -v fedgpu >/dev/null 2>&1; then fedgpu=fedgpu
  else
    echo "note: no fedgpu CLI here (make venv): connection 'compose' not saved" >&2
    return 0
  fi
  "$fedgpu" connection save-compose --compose-file "$ROOT/compose/compose.yaml" >&2 \
    || echo "warning: connection 'compose' not saved (see above); the deployment is up" >&2
}

# `make up` made "compose" the default connection; once the deployment is down the next command
# must not dial it (it answered WRONG_VERSION_NUMBER once, from whatever held the port next).
retire_connection() {
  local fedgpu
  if [ -x "$ROOT/.venv/bin/fedgpu" ]; then fedgpu="$ROOT/.venv/bin/fedgpu"
  elif command -v fedgpu >/dev/null 2>&1; then fedgpu=fedgpu
  else return 0
  fi
  "$fedgpu" connection list --json 2>/dev/null | grep -q '"name": "compose"' || return 0
  "$fedgpu" connection remove compose >&2 \
    || echo "warning: connection 'compose' not removed (see above)" >&2
}

cmd=${1:-}
shift || true
case "$cmd" in
  up)
    profile=${1:-}
    check_profile "$profile"
    shift
    check_engine
    check_gpu_host "$profile"
    check_images "$profile"
    # The certs service hands the operator's key pair to this user, so the CLI here reads it.
    export FEDGPU_OPERATOR_UID FEDGPU_OPERATOR_GID
    FEDGPU_OPERATOR_UID=$(id -u) FEDGPU_OPERATOR_GID=$(id -g)
    docker compose "${files[@]}" --profile "$profile" up -d --no-build "$@"
    save_connection
    ;;
  down)
    check_engine
    docker compose "${files[@]}" "${all_profiles[@]}" down --remove-orphans "$@"
    retire_connection
    ;;
  config)
    check_profile "${1:-}"
    exec docker compose "${files[@]}" --profile "$1" config
    ;;
  *) die "usage: compose/compose.sh up PROFILE | down | config PROFILE" ;;
esac
