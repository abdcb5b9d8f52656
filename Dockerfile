# One image for every tradeloop service: `tradeloop serve trainer|evaluator|feedback|dashboard`
# (docker-compose.yml picks the command).
#
# BASE_IMAGE: a Debian-based image with python3 (3.11+) and its venv module — the official Python image by default;
#   CI passes one it built from the host's apt sources (scripts/docker-ci.sh).
# torch: CPU by default. TORCH_WHEEL names a wheel file under docker/wheels/ to install (CI: the host's CPU wheel);
#   without it torch comes from TORCH_INDEX_URL (the GPU override points it at a CUDA wheel index).
# The image runs as the unprivileged user `tradeloop`, which owns /data/runs and /data/compile-cache: docker-compose.yml
# mounts its named run volume on the first and the trainer's compile cache on the second (a new named volume takes
# that ownership). No VOLUME line: it would give every container started
# without a mount an anonymous volume, left behind by `docker compose down`.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEEL=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A C compiler: the evaluator builds its compiled CPU pass (shared/native.py) at first use, into the user's
# ~/.cache; without one it falls back to the (much slower) torch modes.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && useradd --create-home --uid 10001 tradeloop \
    && mkdir -p /data/runs /data/compile-cache \
    && chown -R tradeloop:tradeloop /data

# torch first, in its own layer: the largest download, unchanged by code edits. The wheel directory is mounted for
# this step only, so the wheel file itself never becomes a layer. docker/drop-tests.sh deletes the test suites
# the wheels ship (~200 MB) in the layer that installed them.
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    --mount=type=bind,source=docker/drop-tests.sh,target=/usr/local/bin/drop-tests \
    if [ -n "$TORCH_WHEEL" ]; then pip install "/wheels/${TORCH_WHEEL##*/}"; \
    else pip install --index-url "$TORCH_INDEX_URL" "torch>=2.11"; fi \
    && sh /usr/local/bin/drop-tests

# The other dependencies and the build backend, read from pyproject.toml (one list): a code edit does not reinstall
# them, and the project's own install below needs no download.
WORKDIR /app
COPY pyproject.toml /app/
RUN --mount=type=bind,source=docker/drop-tests.sh,target=/usr/local/bin/drop-tests \
    python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(p['project']['dependencies'] + p['build-system']['requires']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && sh /usr/local/bin/drop-tests

# The project, installed editable so the dashboard's static files (dashboard/) stay next to the code.
COPY README.md LICENSE /app/
COPY dashboard /app/dashboard
COPY tradeloop /app/tradeloop
COPY shared /app/shared
COPY services /app/services
RUN pip install --no-deps --no-build-isolation -e /app

LABEL org.opencontainers.image.title="tradeloop"
USER tradeloop
EXPOSE 8000 8001 8002 8003
CMD ["tradeloop", "--help"]
