# fusedserve: HTTP inference whose MLP layers run as fused Triton kernels.
#
# Build:  docker build -t fusedserve .
# Run:    docker run --rm --gpus all -p 8000:8000 fusedserve
#         (or `docker compose up` for the service + Prometheus + Grafana)
#
# The base image already carries a CUDA build of torch (2.11, CUDA 12.8 wheels, which run on
# any driver >= 570 and on 525+ through CUDA minor-version compatibility) and the matching
# triton, so the project is installed on top of it WITHOUT touching either: see the constraints
# step below.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

LABEL org.opencontainers.image.title="fusedserve" \
      org.opencontainers.image.description="HTTP inference for MLPs whose layers run as fused Triton kernels"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Triton's JIT compiles a small C launcher stub per kernel signature at run time, so the
# runtime image needs a C compiler and the libc headers (gcc only *recommends* libc6-dev,
# which --no-install-recommends would otherwise leave out).
# DL3008 (pin apt versions) is ignored on purpose: the pinned base image fixes the Ubuntu release
# and so the gcc series; exact package revisions would break the build at every Ubuntu update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Unprivileged runtime user with a writable home for Triton's kernel cache. The tuned kernel configs
# are kept beside the compiled kernels, in the volume compose mounts there: a restart neither recompiles
# nor re-times them.
RUN groupadd --system --gid 10001 fusedserve \
    && useradd --system --uid 10001 --gid fusedserve --create-home --home-dir /home/fusedserve \
        --shell /usr/sbin/nologin fusedserve \
    && mkdir -p /home/fusedserve/.triton/cache \
    && chown -R fusedserve:fusedserve /home/fusedserve/.triton

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    TRITON_CACHE_DIR=/home/fusedserve/.triton/cache \
    FUSEDSERVE_TUNING_CACHE=/home/fusedserve/.triton/cache/fusedserve-tuning.json

WORKDIR /app

# Install the package. torch and triton are pinned to exactly what the base image has, as pip
# constraints: pip keeps them (they already satisfy pyproject's ranges), and if any dependency
# ever asked for another version the build fails here instead of pulling a multi-GB wheel.
COPY pyproject.toml README.md ./
COPY fusedserve/ ./fusedserve/
COPY kernels/ ./kernels/
COPY service/ ./service/
RUN python -c 'from importlib.metadata import version as v; print("torch==" + v("torch")); print("triton==" + v("triton"))' \
        > /tmp/base-constraints.txt \
    && cat /tmp/base-constraints.txt \
    && python -m pip install --no-cache-dir --constraint /tmp/base-constraints.txt . \
    && python -c 'from importlib.metadata import version as v; print("torch==" + v("torch")); print("triton==" + v("triton"))' \
        | diff - /tmp/base-constraints.txt \
    && python -c "import torch, triton; assert torch.version.cuda, 'torch lacks CUDA'; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
    && command -v fusedserve \
    && rm -rf build ./*.egg-info /tmp/base-constraints.txt

# Model weights last: the layers above are reused when only the weights change.
COPY model_weights/ ./model_weights/

# No API docs (/docs, /redoc, /openapi.json) in the image: a deployed service need not describe itself to anyone
# who reaches it (docs/security.md; FUSEDSERVE_DOCS=true brings them back).
ENV FUSEDSERVE_HOST=0.0.0.0 \
    FUSEDSERVE_PORT=8000 \
    FUSEDSERVE_MODEL_DIR=/app/model_weights \
    FUSEDSERVE_MODEL=digits-mlp \
    FUSEDSERVE_MODE=fused \
    FUSEDSERVE_DEVICE=auto \
    FUSEDSERVE_DOCS=false

# Numeric uid:gid (the fusedserve user created above) so runtimes can verify it is not root.
USER 10001:10001

EXPOSE 8000

# Ready only once the weights are loaded and every kernel is compiled, autotuned and warmed for
# each batch-size bucket. The start period covers that on a cold Triton cache (a probe that
# succeeds earlier marks the container healthy at once, so a long period delays nothing).
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/ready' % os.environ.get('FUSEDSERVE_PORT', '8000'), timeout=2)"]

CMD ["fusedserve", "serve"]
