# sigil-push images. `docker build .` builds the last stage, the slim bridge: the API and the
# relay bridge in one process; config, database and observation log live on the /data volume.
# `docker build --target analytics .` adds the analytics extra (PySpark, matplotlib) and a
# Java runtime for `sigil-push analytics`, which the bridge never needs.
FROM python:3.11-slim AS base

RUN useradd --system --create-home --home-dir /home/sigil --uid 10001 sigil

WORKDIR /app
COPY pyproject.toml README.md relays.toml ./
COPY sigil_push ./sigil_push
COPY analytics ./analytics
COPY migrations ./migrations
RUN pip install --no-cache-dir . \
    && mkdir -p /data \
    && sed -e 's/^listen = .*/listen = "0.0.0.0:8080"/' relays.toml > /data/relays.toml \
    && chown -R sigil /data


# Batch reports over an observation log:
#   docker run --rm -v obs:/obs:ro -v reports:/reports sigil-push-analytics \
#       --input /obs --output /reports [--master spark://host:7077]
FROM base AS analytics

# default-jre-headless is the Java that Debian release supports (17 or 21; Spark 4 runs on both).
RUN apt-get update \
    && apt-get install -y --no-install-recommends default-jre-headless \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir '.[analytics]'

USER sigil
ENTRYPOINT ["sigil-push", "analytics"]
CMD ["--help"]


FROM base AS bridge

USER sigil
# A named volume starts as a copy of /data above; a bind mount must bring its own relays.toml.
VOLUME ["/data"]
ENV SIGIL_PUSH_CONFIG=/data/relays.toml
EXPOSE 8080

HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4).status != 200)"]

ENTRYPOINT ["sigil-push"]
CMD ["serve"]
