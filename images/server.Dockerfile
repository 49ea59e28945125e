# fedgpu aggregator: CPU-only, no torch (numpy + grpc), non-root.
#
# Build from the repository root (the context is filtered by /.dockerignore):
#   docker build -f images/server.Dockerfile -t fedgpu/server:dev .
# Air-gapped (what `images/build.sh --offline` passes; only build args differ):
#   --build-arg BASE_IMAGE=fedgpu/base:bookworm-py311 --build-arg PIP_NO_INDEX=1
# with the wheels in images/wheelhouse/.
#
# BASE_IMAGE must provide python3 (>= 3.11) with the venv module; builder and
# runtime use the same base, so the venv's interpreter path is valid in both.
# Pin by digest at a real site: python:3.11.11-slim-bookworm@sha256:<digest>.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

# The runtime requirements alone, read from pyproject.toml (tomllib: Python 3.11+).
# A stage of its own so that an edit elsewhere in pyproject.toml (dev extras,
# tool settings) leaves the dependency layer below cached.
FROM ${BASE_IMAGE} AS requirements
# Extras of pyproject.toml the aggregator carries, comma-separated. "tracking" (MLflow's
# client, for --tracking-uri / FEDGPU_TRACKING_URI) by default: without it the option is
# offered but fails with "pip install 'fedgpu[tracking]'". Measured on the offline build
# (2026-11): 805 MB against 700 MB without it (+105 MB: mlflow-skinny, SQLAlchemy, Alembic and
# their dependencies; imported only when a tracking URI is given). An aggregator that will
# never track: --build-arg SERVER_EXTRAS= (empty).
ARG SERVER_EXTRAS=tracking
COPY pyproject.toml /pyproject.toml
RUN SERVER_EXTRAS="${SERVER_EXTRAS}" python3 -c "import os, tomllib; p = tomllib.load(open('/pyproject.toml', 'rb'))['project']; extras = [e for e in os.environ['SERVER_EXTRAS'].split(',') if e.strip()]; print('\n'.join(p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e.strip()]]))" > /requirements.txt

FROM ${BASE_IMAGE} AS builder
# PyPI by default; a site mirror via PIP_INDEX_URL; PIP_NO_INDEX=1 installs from
# images/wheelhouse/ only (no network at all during the build).
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_NO_INDEX=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_FIND_LINKS=/build/wheelhouse \
    PATH=/opt/venv/bin:${PATH}
WORKDIR /build
RUN python3 -m venv /opt/venv
COPY images/wheelhouse/ /build/wheelhouse/
# Dependencies first, so a source change does not reinstall them.
COPY --from=requirements /requirements.txt /build/requirements.txt
RUN pip install --only-binary=:all: -r /build/requirements.txt
# fedgpu itself as a wheel, installed in the runtime stage: a source edit then
# rebuilds a small layer instead of copying the whole venv again.
COPY . /build/src/
RUN pip wheel --no-deps --wheel-dir /build/dist /build/src

FROM ${BASE_IMAGE} AS runtime
LABEL org.opencontainers.image.title="fedgpu aggregator" \
      org.opencontainers.image.description="CPU-only federated-learning aggregator (gRPC)"
# A fixed UID/GID so volume ownership is predictable across hosts and rebuilds.
RUN groupadd --system --gid 10001 fedgpu \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/fedgpu --no-create-home \
      --shell /usr/sbin/nologin fedgpu \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/fedgpu \
 && install -d -m 0755 /etc/fedgpu
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /build/dist/ /tmp/dist/
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps /tmp/dist/*.whl \
 && rm -rf /tmp/dist \
 && /opt/venv/bin/pip check \
 && if /opt/venv/bin/python -c "import torch" 2>/dev/null; then \
      echo "torch must not be in the aggregator image" >&2; exit 1; \
    fi
# A default job so the image runs on its own; compose mounts the real one over it.
COPY compose/job.toml /etc/fedgpu/job.toml
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FEDGPU_PORT=50051 \
    FEDGPU_STATE_DIR=/var/lib/fedgpu
USER 10001:10001
WORKDIR /var/lib/fedgpu
# Checkpoints (global weights + round state): keep them across restarts.
VOLUME ["/var/lib/fedgpu"]
EXPOSE 50051
# Probes the standard grpc.health.v1 service on the port the server listens on.
# The generous timeout covers the CLI's start-up (about 5 s measured on a 2-core
# host at load 14), which would otherwise read as "unhealthy".
HEALTHCHECK --interval=10s --timeout=15s --start-period=30s --retries=3 \
  CMD ["sh", "-c", "exec fedgpu health --address \"127.0.0.1:${FEDGPU_PORT:-50051}\""]
# Python turns SIGINT into KeyboardInterrupt even as PID 1, so `docker stop`
# shuts the server down cleanly instead of waiting for SIGKILL.
STOPSIGNAL SIGINT
ENTRYPOINT ["fedgpu"]
CMD ["server", "start", "--job", "/etc/fedgpu/job.toml", "--host", "0.0.0.0"]
