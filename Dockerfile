# One image for every Zattera process; compose.yaml picks the command per container. Its base is made on this
# machine, no registry needed (`python -m cli.stack_images`, docs/containers.md "The control plane under
# compose"): this machine's Python and Zattera's runtime dependencies as one layer, with how the image runs
# (user nobody, PYTHONPATH=/app:/app/proto:…). This adds Zattera's source as one more layer
# and nothing else: every further step would copy the whole root filesystem again on a vfs daemon, and
# nothing is installed here, so the build needs no network.
ARG BASE=zattera/runtime:latest
FROM ${BASE}
COPY . /app
