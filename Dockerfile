# One image for the whole project: the router, the fake engine and the operator are console scripts
# of one venv (/opt/routerfleet), on PATH. There is no ENTRYPOINT: the command names the program, as
# the Kubernetes manifests do (`command: ["routerfleet-router", ...]`); with no command the image
# prints the router's --help.
#
#   docker run --rm IMAGE routerfleet-fake-engine --help
#   docker run --rm --network host IMAGE routerfleet-router --worker url=http://127.0.0.1:8000,...
#
# Base image (build argument BASE_IMAGE): any Debian-like image with Python >= 3.11 as `python3`
# and its venv module. The default, routerfleet-base:bookworm, is made locally without a registry
# by e2e/image/build.sh (debootstrap of Debian bookworm + `docker import`). Where a registry is
# reachable, an upstream image works as is:
#
#   docker build --build-arg BASE_IMAGE=python:3.11-slim -t routerfleet:dev .
#
# Two ways to get the Python packages:
#   * wheelhouse (offline, for air-gapped builds and for CI here, where containers cannot reach the
#     package index): put every wheel, including routerfleet's own and its native core's, in
#     build/wheelhouse/ in the build context; they are installed with `pip install --no-index`.
#     e2e/image/build.sh does this, with the native wheel `make setup` built:
#       python3.11 -m pip wheel --find-links native/target/wheels --wheel-dir build/wheelhouse '.[speed]'
#     The wheels must suit the base image's Python (same major.minor, glibc Linux x86_64).
#   * otherwise (no build/wheelhouse/*.whl in the context): pip installs the project and its native
#     core (native/) from source and the dependencies from the package index, so the build needs
#     network access and a base image with a Rust toolchain (cargo) for the native core.
#
# Works with the legacy builder and with BuildKit (no RUN --mount, no syntax line to fetch).

ARG BASE_IMAGE=routerfleet-base:bookworm

FROM ${BASE_IMAGE} AS build
# Lets e2e/image/build.sh remove this stage's leftover image (the legacy builder keeps it, untagged).
LABEL org.routerfleet.stage=build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
# The context is filtered by .dockerignore: the package sources, pyproject.toml, README.md and the
# wheelhouse (if any).
COPY . /src
RUN set -eu; \
    python3 -m venv /opt/routerfleet; \
    pip=/opt/routerfleet/bin/pip; \
    if ls /src/build/wheelhouse/*.whl >/dev/null 2>&1; then \
        echo "installing from the wheelhouse (--no-index)"; \
        "$pip" install --no-index --find-links /src/build/wheelhouse 'routerfleet[speed]'; \
    else \
        echo "no wheelhouse in the context: installing from source with the package index"; \
        "$pip" install /src/native '/src[speed]'; \
    fi; \
    "$pip" check; \
    /opt/routerfleet/bin/python -c 'import router_runtime.cli, routerfleet_fake_engine.cli'

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="routerfleet" \
      org.opencontainers.image.description="KV-cache-aware LLM routers on Kubernetes: router, fake engine, operator" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric non-root user, so Kubernetes' runAsNonRoot can verify it. The passwd entry is a
# courtesy (the image works without it, e.g. on bases without useradd).
RUN if command -v useradd >/dev/null 2>&1; then \
        useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
                --shell /usr/sbin/nologin routerfleet; \
    fi
COPY --from=build /opt/routerfleet /opt/routerfleet
ENV PATH=/opt/routerfleet/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /tmp
CMD ["routerfleet-router", "--help"]
