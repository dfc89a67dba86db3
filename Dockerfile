# syntax=docker/dockerfile:1
# One image for the webhook and the node agent: ghcr.io/scrubgate/scrubgate:<version>, with the `server`
# extra (what runs in a cluster) and the `gpu` extra (tools/install-image.sh).
# One image, not two, because the `gpu` extra is only Python bindings (nvidia-ml-py, cuda-bindings, a few
# MB) that load the driver libraries the NVIDIA container runtime mounts into the agent's container; the
# webhook never imports them. One tag to pin, scan and sign, and the webhook and the agent can never run
# different versions of the policy core they share.
#   docker build -t ghcr.io/scrubgate/scrubgate:0.1.0 .
# Both stages use one base, pinned to an exact patch release (spelled out, not an ARG, so that hadolint
# sees the pin); add its digest where the release pipeline can resolve it (`...-slim-bookworm@sha256:...`).
# The same base in both stages: the virtualenv's python links to the base's interpreter.
FROM python:3.12.12-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scrubgate/ scrubgate/
COPY policies/ policies/
COPY webhook/ webhook/
COPY sanitizer_agent/ sanitizer_agent/
COPY certs/ certs/
COPY tools/install-image.sh tools/
ENV PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN sh tools/install-image.sh /src /opt/scrubgate

FROM python:3.12.12-slim-bookworm
LABEL org.opencontainers.image.source="https://github.com/scrubgate/scrubgate" \
      org.opencontainers.image.title="scrubgate" \
      org.opencontainers.image.description="Admission webhook and node agent that scrub GPUs between DRA claims" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/scrubgate /opt/scrubgate
# The root filesystem is read-only in the pods: nothing may try to write bytecode or a cache under it.
ENV PATH=/opt/scrubgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# The nonroot user of distroless images; the webhook runs as it. The agent's DaemonSet overrides it with
# root for the node's hostPath directories (see manifests/agent-daemonset.yaml).
USER 65532:65532
ENTRYPOINT ["scrubgate"]
CMD ["--help"]
