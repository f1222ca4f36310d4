# syntax=docker/dockerfile:1
# kvxferd image: build a wheel in one stage, install it into a clean runtime as a non-root user.

FROM python:3.11.14-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvxferd ./kvxferd
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11.14-slim-bookworm AS runtime
LABEL org.opencontainers.image.title="kvxferd" \
      org.opencontainers.image.description="KV-cache transfer sidecar daemon for disaggregated LLM serving" \
      org.opencontainers.image.version="0.1.0"
# The side channel listens on every address and so requires CurveZMQ: mount this node's keys from
# `kvxferd keys generate DIR --owner 10001` at /etc/kvxferd/curve (the peers it admits in
# DIR/authorized); without them the daemon refuses to start and says what to do. Serving this host only instead:
# -e KVXFERD_SIDE_CHANNEL_HOST=127.0.0.1 -e KVXFERD_CURVE_SECRET_KEY_FILE= (docs/deploy.md).
# DL3064: these name where the keys are mounted; no key is in the image.
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    KVXFERD_SOCKET_PATH=/run/kvxferd/kvxferd.sock \
    KVXFERD_SIDE_CHANNEL_HOST=0.0.0.0 \
    KVXFERD_CURVE_SECRET_KEY_FILE=/etc/kvxferd/curve/kvxferd.key_secret \
    KVXFERD_METRICS_HOST=127.0.0.1 \
    KVXFERD_LOG_FORMAT=json
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels kvxferd==0.1.0 \
    && rm -rf /wheels \
    && groupadd --system --gid 10001 kvxferd \
    && useradd --system --uid 10001 --gid kvxferd --no-create-home --shell /usr/sbin/nologin kvxferd \
    && mkdir -p /run/kvxferd \
    && chown kvxferd:kvxferd /run/kvxferd \
    && chmod 0750 /run/kvxferd
USER 10001:10001
EXPOSE 5600 9410
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9410/readyz', timeout=2).status != 200)"]
ENTRYPOINT ["kvxferd"]
CMD ["serve"]
