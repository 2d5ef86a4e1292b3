# One image for every pdcluster role: redis is the official image; model, prefill, decode and proxy
# run this one with different commands (see docker-compose.yml).
#
# CPU (default):  docker build -t pdcluster:cpu .
# GPU (CUDA 13):  docker build -t pdcluster:gpu \
#                   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 \
#                   --build-arg TRANSFER_EXTRA=transfer-cuda .
# TRANSFER_EXTRA picks Mooncake's build: pyproject's transfer-cpu or transfer-cuda extra. The GPU
# build was not tried: see docs/deployment.md.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Mooncake Transfer Engine loads libibverbs.so.1 even when it moves bytes over tcp.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/*

# torch first and alone: the biggest layer, and the one the CPU and GPU images differ in.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# The project's dependencies, read from pyproject.toml, so that editing the source does not
# reinstall them. TRANSFER_EXTRA names an optional-dependency group (empty: none).
WORKDIR /opt/pdcluster
COPY pyproject.toml README.md ./
ARG TRANSFER_EXTRA=transfer-cpu
RUN python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extra = sys.argv[1]; print('\n'.join(p['dependencies'] + (p['optional-dependencies'][extra] if extra else [])))" \
        "${TRANSFER_EXTRA}" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The source (.dockerignore keeps tests, models, docs and caches out), installed as a package.
COPY . .
RUN pip install ".${TRANSFER_EXTRA:+[${TRANSFER_EXTRA}]}" \
    && rm -rf build *.egg-info

# Run as an unprivileged user. /models is where the compose file's named volume is mounted: a new
# volume takes this directory's owner, so the user can write the tiny model there.
RUN useradd --create-home --uid 1000 pdcluster \
    && mkdir -p /models \
    && chown pdcluster:pdcluster /models
USER pdcluster
WORKDIR /home/pdcluster

# 8000: the proxy's HTTP API; 50051/50052: the nodes' gRPC ports in docker-compose.yml. Mooncake picks
# its own ports at run time (reachable inside the compose network, never published).
EXPOSE 8000 50051 50052
CMD ["pdctl", "--help"]
