#!/usr/bin/env bash
# Build the fedgpu images (what `make images` runs).
#
#   images/build.sh [--offline] [--only server|node] [--no-cache]
#
# Online (default): BASE_IMAGE and torch come from the Dockerfiles' defaults
# (registry base images, PyTorch's CUDA index, PyPI); pass overrides through
# FEDGPU_SERVER_BUILD_ARGS / FEDGPU_NODE_BUILD_ARGS ("--build-arg K=V ...").
#
# --offline (air-gapped sites, CI, test machines without a registry): first
#   1. the base image FEDGPU_OFFLINE_BASE (Debian bookworm minbase + python3.11,
#      made with debootstrap, rootfs tarball cached in FEDGPU_CACHE), then
#   2. the wheelhouse images/wheelhouse/ (every wheel both images need; torch is
#      copied from FEDGPU_TORCH_WHEEL, never resolved from an index; cached in
#      FEDGPU_CACHE/wheelhouse),
# and then builds the SAME Dockerfiles with build args only.
#
# Environment: FEDGPU_SERVER_IMAGE (fedgpu/server:dev), FEDGPU_NODE_IMAGE
# (fedgpu/node:dev), FEDGPU_CACHE (~/.cache/fedgpu-e2e), FEDGPU_OFFLINE_BASE
# (fedgpu/base:bookworm-py311), FEDGPU_TORCH_WHEEL (a local torch wheel,
# default: the newest /opt/wheels/torch-*+cpu-cp311-*.whl),
# FEDGPU_DEBIAN_MIRROR (http://deb.debian.org/debian).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SERVER_IMAGE=${FEDGPU_SERVER_IMAGE:-fedgpu/server:dev}
NODE_IMAGE=${FEDGPU_NODE_IMAGE:-fedgpu/node:dev}
CACHE=${FEDGPU_CACHE:-$HOME/.cache/fedgpu-e2e}
OFFLINE_BASE=${FEDGPU_OFFLINE_BASE:-fedgpu/base:bookworm-py311}
MIRROR=${FEDGPU_DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELHOUSE=$ROOT/images/wheelhouse

offline=0
only=""
nocache=()
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) offline=1 ;;
    --only) only=${2:?--only needs server or node}; shift ;;
    --no-cache) nocache=(--no-cache) ;;
    -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$only" in ""|server|node) ;; *) echo "build.sh: --only takes server or node, not '$only'" >&2; exit 2 ;; esac

# The offline build never resolves torch from an index: find its wheel before anything slow
# (the base image takes minutes), and say where to put one.
TORCH_WHEEL=${FEDGPU_TORCH_WHEEL:-}
if [ "$offline" = 1 ]; then
  if [ -z "$TORCH_WHEEL" ]; then
    TORCH_WHEEL=$(ls /opt/wheels/torch-*+cpu-cp311-cp311-*x86_64.whl 2>/dev/null | sort -V | tail -1 || true)
  fi
  if [ ! -f "$TORCH_WHEEL" ]; then
    echo "build.sh: the offline build needs a local torch wheel for Python 3.11 and found none" \
         "${FEDGPU_TORCH_WHEEL:+(FEDGPU_TORCH_WHEEL=$FEDGPU_TORCH_WHEEL is not a file)}." \
         "Put one in /opt/wheels/ (torch-<version>+cpu-cp311-cp311-linux_x86_64.whl) or point" \
         "FEDGPU_TORCH_WHEEL at it; on a machine with an index: pip download --no-deps" \
         "--python-version 3.11 --only-binary=:all: -d /opt/wheels 'torch==2.13.0+cpu'" >&2
    exit 1
  fi
fi

log() { printf '[build %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
# step NAME CMD...: run a step and report how long it took.
step() {
  local name=$1 t0=$SECONDS; shift
  log "$name ..."
  "$@"
  log "$name done in $((SECONDS - t0))s"
}

if ! docker info >/dev/null 2>&1; then
  echo "build.sh: no Docker engine answers (docker info failed)." \
       "Install/start one, e.g. 'bash tests/e2e/setup_docker.sh'." >&2
  exit 1
fi

# BuildKit when the buildx plugin is there; otherwise the classic builder (the
# Dockerfiles use nothing BuildKit-only, so both give the same images).
if docker buildx version >/dev/null 2>&1; then
  build() { DOCKER_BUILDKIT=1 docker build "$@"; }
else
  # (its notice that the classic builder is deprecated is filtered out)
  build() { DOCKER_BUILDKIT=0 docker build "$@" 2> >(grep -v -e 'DEPRECATED: The legacy builder' \
      -e 'Install the buildx component' -e 'docs.docker.com/go/buildx' \
      -e 'BuildKit is currently disabled' -e 'environment-variable\.' -e '^ *$' >&2); }
fi

# --- offline base image -------------------------------------------------------
make_base_tarball() {
  local tarball=$1 rootfs
  command -v debootstrap >/dev/null || { echo "build.sh: debootstrap missing (apt-get install debootstrap)" >&2; exit 1; }
  rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  # python3-venv brings ensurepip (pip for the venv); ca-certificates for
  # sites that later install from an HTTPS mirror.
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$MIRROR" > "$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; rm -rf "$rootfs"; exit 1; }
  # An image needs no package cache, apt lists or docs.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
         "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/tmp/*
  tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$rootfs"
}

ensure_base_image() {
  if docker image inspect "$OFFLINE_BASE" >/dev/null 2>&1; then
    log "base image $OFFLINE_BASE already in the engine"
    return
  fi
  local tarball=$CACHE/debian-bookworm-minbase-py311.tar
  if [ ! -s "$tarball" ]; then
    step "debootstrap bookworm minbase -> $tarball" make_base_tarball "$tarball"
  fi
  step "docker import $OFFLINE_BASE" docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    "$tarball" "$OFFLINE_BASE" >/dev/null
}

# --- offline wheelhouse -------------------------------------------------------
ensure_wheelhouse() {
  local torch_wheel=$TORCH_WHEEL torch_version
  torch_version=$(basename "$torch_wheel" | cut -d- -f2)
  TORCH_SPEC="torch==$torch_version"

  mkdir -p "$CACHE/wheelhouse"
  cp -u "$torch_wheel" "$CACHE/wheelhouse/"
  echo "$TORCH_SPEC" > "$CACHE/torch-constraint.txt"
  # Requirements straight from pyproject.toml (base + node and tracking extras + the
  # build backend), downloaded as wheels for the image's interpreter and platform
  # (CPython 3.11, glibc 2.36, x86_64), whatever the host runs. The torch pin
  # has a local version (+cpu) that only the local wheel matches.
  python3 - "$ROOT/pyproject.toml" > "$CACHE/requirements.txt" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
build = project["build-system"]["requires"]
p = project["project"]
# The aggregator image's default SERVER_EXTRAS (tracking: MLflow) as well.
extras = p["optional-dependencies"]
print("\n".join(build + ["wheel"] + p["dependencies"] + extras["node"] + extras["tracking"]))
PY
  # Skip the resolver when neither the requirements nor the torch pin changed.
  local stamp
  stamp=$(cat "$CACHE/requirements.txt" "$CACHE/torch-constraint.txt" | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$CACHE/wheelhouse/.stamp" 2>/dev/null)" = "$stamp" ]; then
    log "wheelhouse: requirements unchanged since the last download"
  else
    download_wheels
    echo "$stamp" > "$CACHE/wheelhouse/.stamp"
  fi
  # Into the build context (hard links when the cache is on the same disk).
  cp -ul "$CACHE"/wheelhouse/*.whl "$WHEELHOUSE/" 2>/dev/null || cp -u "$CACHE"/wheelhouse/*.whl "$WHEELHOUSE/"
  log "wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
}

download_wheels() {
  # pip does not widen a given --platform to older manylinux levels: list them.
  local platforms=(--platform manylinux2014_x86_64 --platform linux_x86_64)
  local minor
  for minor in $(seq 5 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
  python3 -m pip download --quiet --dest "$CACHE/wheelhouse" \
    --find-links "$CACHE/wheelhouse" \
    --only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 \
    "${platforms[@]}" \
    -c "$CACHE/torch-constraint.txt" -r "$CACHE/requirements.txt"
}

server_args=()
node_args=()
if [ "$offline" = 1 ]; then
  mkdir -p "$CACHE"
  ensure_base_image
  step "wheelhouse" ensure_wheelhouse
  server_args=(--build-arg "BASE_IMAGE=$OFFLINE_BASE" --build-arg PIP_NO_INDEX=1)
  node_args=("${server_args[@]}" --build-arg "TORCH_SPEC=$TORCH_SPEC")
fi
# shellcheck disable=SC2206  # word splitting of the user's extra args is intended
server_args+=(${FEDGPU_SERVER_BUILD_ARGS:-})
# shellcheck disable=SC2206
node_args+=(${FEDGPU_NODE_BUILD_ARGS:-})

cd "$ROOT"
if [ -z "$only" ] || [ "$only" = server ]; then
  step "build $SERVER_IMAGE" build "${nocache[@]}" -f images/server.Dockerfile "${server_args[@]}" -t "$SERVER_IMAGE" .
fi
if [ -z "$only" ] || [ "$only" = node ]; then
  step "build $NODE_IMAGE" build "${nocache[@]}" -f images/node.Dockerfile "${node_args[@]}" -t "$NODE_IMAGE" .
fi
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^($SERVER_IMAGE|$NODE_IMAGE|$OFFLINE_BASE) " >&2 || true
