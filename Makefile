# The two commands of the README's quick start: `make demo` and `make test`.
# Each creates the virtual environment if it is missing; torch==2.13.0 is installed first so
# pip takes the CPU wheel instead of a multi-GB CUDA build. Three stamps, three install sizes:
#   $(STAMP)       the package and its runtime dependencies only (make demo)
#   $(DEV)         + the dev tools: pytest, ruff, mypy, moto, s3fs... (make test-fast, lint)
#   $(FRAMEWORKS)  + the frameworks the fixtures are written with (make test)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CKPT := $(VENV)/bin/ckpt
STAMP := $(VENV)/.ckpt-installed
DEV := $(VENV)/.ckpt-dev
FRAMEWORKS := $(VENV)/.ckpt-frameworks
DEMO := build/demo
PIP := $(PY) -m pip install -qqq --disable-pip-version-check
# the fast loop: no framework fixtures, no torchrun launches, nothing marked slow
FAST := not frameworks and not torchrun and not slow
# test-fast's workers: one per core
JOBS ?= $(shell $(PYTHON) -c 'import os; print(len(os.sched_getaffinity(0)))' 2>/dev/null || echo 2)

.PHONY: demo test test-fast lint typecheck docs pytest frameworks bench completions clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) torch==2.13.0 -e .
	touch $(STAMP)

$(DEV): $(STAMP)
	$(PIP) torch==2.13.0 -e '.[dev]'
	touch $(DEV)

# the frameworks the tests build fixtures with; DeepSpeed needs its ops left unbuilt (no CUDA)
# and the installed torch visible to its build (no build isolation)
$(FRAMEWORKS): $(DEV)
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

test: $(STAMP) lint typecheck docs pytest

lint: $(DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(DEV)
	$(VENV)/bin/mypy

# the documentation site (docs/, mkdocs.yml) into build/site; strict: a broken link or anchor fails
docs: $(DEV)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# the whole suite, one pytest-xdist worker per core as the fast loop; `--dist loadfile` keeps
# each test module on one worker, so a module's session fixtures (a DeepSpeed run, a Trainer
# run) are built once, not once per worker (serial, the suite took about an hour of CI's 90
# minutes on 2 cores)
pytest: $(FRAMEWORKS)
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile

# the edit-test loop (under 3 minutes on 2 cores): the dev tools only, no frameworks installed,
# the tests spread over one worker per core (pytest-xdist). PYTHONDONTWRITEBYTECODE is lifted
# for it: set, pytest rewrites the asserts of every test module again at each run (~20 s of
# each worker's time here), where it otherwise keeps them in __pycache__ (ignored by git)
test-fast: $(DEV)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(JOBS) -m "$(FAST)"

completions: $(DEV)
	$(PY) -m ckpt_cli.cli.completions completions
	$(PY) -m ckpt_cli.cli.render.schema schema/ckpt-json.schema.json

# every benchmark with its defaults (several minutes, a few GB of scratch data); see bench/README.md
bench: $(DEV)
	for script in bench/*.py; do echo "== $$script"; PYTHONPATH=$(CURDIR) $(PY) $$script || exit 1; done

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
