# fedgpu training node: PyTorch (CUDA-capable), NVML via nvidia-ml-py, non-root.
#
# Build from the repository root (the context is filtered by /.dockerignore):
#   docker build -f images/node.Dockerfile -t fedgpu/node:dev .
# Air-gapped (what `images/build.sh --offline` passes; only build args differ):
#   --build-arg BASE_IMAGE=fedgpu/base:bookworm-py311 --build-arg PIP_NO_INDEX=1 \
#   --build-arg TORCH_SPEC=torch==2.13.0+cpu
# with torch and every other wheel in images/wheelhouse/.
#
# Default base: nvidia/cuda:12.6.3-base-ubuntu24.04. "base", not "runtime": the
# CUDA wheels of torch bring their own CUDA user-space libraries (cuBLAS, cuDNN,
# ...), so a runtime image would carry them twice. The image still sets
# NVIDIA_REQUIRE_CUDA=cuda>=12.6, so the NVIDIA Container Toolkit refuses a host
# driver too old for the cu126 torch build below. Ubuntu 24.04, not 22.04:
# fedgpu needs Python >= 3.11 and 22.04 ships 3.10. Keep the CUDA minor of the
# base and of TORCH_INDEX_URL equal; pin by digest at a real site
# (nvidia/cuda:12.6.3-base-ubuntu24.04@sha256:<digest>).
ARG BASE_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04

# The CUDA images have no Python: add it from the distribution when missing.
# Images that already have python3 + venv (python:*, the offline Debian base)
# skip apt entirely, which is what lets the offline build run without network.
FROM ${BASE_IMAGE} AS python-base
# hadolint ignore=DL3008
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
           python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -c "import sys; assert sys.version_info >= (3, 11), sys.version"

# The runtime requirements alone, read from pyproject.toml (tomllib: Python 3.11+).
# A stage of its own so that an edit elsewhere in pyproject.toml (dev extras,
# tool settings) leaves the dependency layer below cached.
FROM python-base AS requirements
COPY pyproject.toml /pyproject.toml
RUN python3 -c "import tomllib; p = tomllib.load(open('/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['node']))" > /requirements.txt

FROM python-base AS builder
# torch comes from TORCH_INDEX_URL only (the PyTorch CUDA index: PyPI's plain
# "torch" is a different build); everything else from PIP_INDEX_URL (PyPI or a
# site mirror). PIP_NO_INDEX=1 installs from images/wheelhouse/ only.
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_NO_INDEX=0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_SPEC=torch==2.9.1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_FIND_LINKS=/build/wheelhouse \
    PATH=/opt/venv/bin:${PATH}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /build
RUN python3 -m venv /opt/venv
COPY images/wheelhouse/ /build/wheelhouse/
# 1. torch alone, then pin exactly what was installed, so the later installs
#    can never replace it with another build resolved from PyPI.
#    (DL3013: the version is pinned, through the TORCH_SPEC build arg.)
# hadolint ignore=DL3013
RUN pip install --only-binary=:all: --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" \
 && pip freeze --all | grep -i '^torch==' > /build/torch-pin.txt \
 && cat /build/torch-pin.txt
# 2. The other dependencies (cached across source edits).
COPY --from=requirements /requirements.txt /build/requirements.txt
RUN pip install --only-binary=:all: -c /build/torch-pin.txt -r /build/requirements.txt
# 3. fedgpu itself as a wheel, installed in the runtime stage: a source edit then
#    rebuilds a small layer instead of copying the whole venv (torch) again.
COPY . /build/src/
RUN pip wheel --no-deps --wheel-dir /build/dist /build/src \
 && cp /build/torch-pin.txt /build/dist/

FROM python-base AS runtime
LABEL org.opencontainers.image.title="fedgpu node" \
      org.opencontainers.image.description="fedgpu training agent (PyTorch, NVML)"
RUN groupadd --system --gid 10001 fedgpu \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/fedgpu \
      --shell /usr/sbin/nologin fedgpu \
 && install -d -o 10001 -g 10001 -m 0750 /data \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/fedgpu/node
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /build/dist/ /tmp/dist/
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps /tmp/dist/*.whl \
 && /opt/venv/bin/pip check \
 && /opt/venv/bin/pip freeze --all | grep -i '^torch==' | diff - /tmp/dist/torch-pin.txt \
 && rm -rf /tmp/dist
# NVIDIA_* make the NVIDIA Container Toolkit inject the driver, libnvidia-ml
# (NVML) and the device nodes; "utility" is what NVML needs, "compute" CUDA.
# FEDGPU_GPU=offer: use a GPU when the job asks for one and a usable GPU exists,
# otherwise train on CPU and report why. FEDGPU_TASK_APPROVAL=approved: a task bundle sent
# with a job runs once this site approved its sha256 (`fedgpu node approve`), kept with the
# bundle cache in FEDGPU_NODE_STATE (mount a volume there to keep approvals).
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FEDGPU_GPU=offer \
    FEDGPU_DATA=/data \
    FEDGPU_NODE_STATUS=/tmp/fedgpu-node-status.json \
    FEDGPU_TASK_APPROVAL=approved \
    FEDGPU_NODE_STATE=/var/lib/fedgpu/node
USER 10001:10001
WORKDIR /home/fedgpu
# Fails when the agent stopped refreshing its status file (hung or dead loop).
# Timeout as in server.Dockerfile: CLI start-up is slow on a loaded host.
HEALTHCHECK --interval=15s --timeout=15s --start-period=60s --retries=3 \
  CMD ["fedgpu", "node", "health"]
STOPSIGNAL SIGINT
ENTRYPOINT ["fedgpu"]
# --gpu comes from FEDGPU_GPU (offer above), so `-e FEDGPU_GPU=none` works too.
CMD ["node", "start"]
