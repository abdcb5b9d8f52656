# One image for every tradeloop service: `tradeloop serve trainer|evaluator|feedback|dashboard`
# (docker-compose.yml picks the command). CPU torch by default; the GPU override builds with
# TORCH_INDEX_URL pointing at a CUDA wheel index.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A C compiler: the evaluator builds its compiled CPU pass (shared/native.py) at first use; without one it falls
# back to the (much slower) torch modes.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: the largest download, and unchanged by code edits.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.11"

# The project, installed editable so the dashboard's static files (dashboard/) stay next to the code.
COPY . /app
RUN pip install -e /app \
    && useradd --create-home --uid 10001 tradeloop \
    && mkdir -p /data/runs \
    && chown -R tradeloop /data

USER tradeloop
VOLUME ["/data/runs"]
EXPOSE 8000 8001 8002 8003
CMD ["tradeloop", "--help"]
