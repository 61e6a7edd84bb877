# The two commands of the README's quick start: `make demo` and `make test`.
# Both create the virtual environment if it is missing; torch==2.13.0 is installed first so
# pip takes the CPU wheel instead of a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CKPT := $(VENV)/bin/ckpt
STAMP := $(VENV)/.ckpt-installed
FRAMEWORKS := $(VENV)/.ckpt-frameworks
DEMO := build/demo
PIP := $(PY) -m pip install -qqq --disable-pip-version-check

.PHONY: demo test lint typecheck pytest frameworks bench completions clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) torch==2.13.0 -e '.[dev,frameworks]'
	touch $(STAMP)

# the frameworks the tests build fixtures with; DeepSpeed needs its ops left unbuilt (no CUDA)
# and the installed torch visible to its build (no build isolation)
$(FRAMEWORKS): $(STAMP)
	$(PIP) torch==2.13.0 -e '.[dev,frameworks]'
	DS_BUILD_OPS=0 $(PIP) --no-build-isolation torch==2.13.0 deepspeed
	# torchtitan 0.3.0 pins datasets<4.8 (and so an older fsspec than s3fs wants) and pulls
	# wandb / tensorboard: install it without its deps; the extra holds what its model and
	# CheckpointManager code import (tyro, torchdata, spmd_types, torch_checkpointing, triton)
	$(PIP) --no-deps torchtitan==0.3.0
	touch $(FRAMEWORKS)

frameworks: $(FRAMEWORKS)

demo: $(STAMP)
	rm -rf $(DEMO)
	$(PY) examples/make_demo.py $(DEMO)
	$(CKPT) inspect $(DEMO)/model
	$(CKPT) inspect $(DEMO)/checkpoint-4
	$(CKPT) verify $(DEMO)/model
	$(CKPT) verify --resumable $(DEMO)/checkpoint-4

test: $(STAMP) lint typecheck pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(FRAMEWORKS)
	$(PY) -m pytest -q

completions: $(STAMP)
	$(PY) -m ckpt_cli.completions completions
	$(PY) -m ckpt_cli.render.schema schema/ckpt-json.schema.json

# every benchmark with its defaults (several minutes, a few GB of scratch data); see bench/README.md
bench: $(STAMP)
	for script in bench/*.py; do echo "== $$script"; PYTHONPATH=$(CURDIR) $(PY) $$script || exit 1; done

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
