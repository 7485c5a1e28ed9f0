# One image for every Zattera service; compose.yaml picks the command per service.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY shared ./shared
COPY services ./services
COPY cli ./cli
RUN pip install --no-cache-dir .
ENV ZATTERA_NATS_URL=nats://nats:4222
USER nobody
CMD ["zattera", "--help"]
