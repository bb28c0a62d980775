# One image for both programs: `gpuwarden agent ...` on every node, `gpuwarden aggregator ...`
# for the fleet service (daemonset/ passes the subcommand as the first argument).
#
#   docker build -t gpuwarden:0.1.0 .
#
# The agent imports neither numpy nor scikit-learn (tests/test_packaging.py), so they cost the
# agent disk space, not memory. Bookworm pins the Debian release under Python 3.11.
#
# BASE lets a site build on its own copy of that image, or on any base with Python 3.11, a `pip`
# on PATH that installs where `gpuwarden` lands on PATH, and groupadd/useradd (scripts/build-image
# --local-base makes one with debootstrap, for a machine without Docker Hub).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what `pip install` reads: pyproject.toml, README.md (the package's readme) and the
# packages it lists. Tests, fixtures and benchmarks stay out of the image (.dockerignore too).
COPY pyproject.toml README.md /build/
COPY agent/ /build/agent/
COPY aggregator/ /build/aggregator/
COPY gpuwarden/ /build/gpuwarden/
COPY sim/ /build/sim/
# An offline build (scripts/build-image --wheels) points pip at wheels that the host serves on
# loopback, and at nothing else; pip reads both settings from the environment. A plain build
# leaves them unset, and pip reads PyPI. (Served rather than copied in: a COPY would leave the
# wheels in a layer of the image.)
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
RUN pip install /build && rm -rf /build

# The detection rules are data the aggregator reads at start (--rules); the Deployment points at
# this directory, and the site-rules component can replace it with a ConfigMap.
COPY rules/ /usr/share/gpuwarden/rules/

# A fixed numeric uid, so that runAsNonRoot can check it and runAsUser in daemonset/ matches.
RUN groupadd --system --gid 65532 gpuwarden \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin gpuwarden
USER 65532:65532

EXPOSE 8080 9835
ENTRYPOINT ["gpuwarden"]
CMD ["--help"]
