# The two commands of the README's quick start: `make demo` and `make test`.
# Both create the virtual environment if it is missing; torch==2.13.0 is installed first so
# pip takes the CPU wheel instead of a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CKPT := $(VENV)/bin/ckpt
STAMP := $(VENV)/.ckpt-installed
DEMO := build/demo
PIP := $(PY) -m pip install -qqq --disable-pip-version-check

.PHONY: demo test lint typecheck pytest bench completions clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) torch==2.13.0 -e '.[dev,frameworks]'
	touch $(STAMP)

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

pytest: $(STAMP)
	$(PY) -m pytest -q

completions: $(STAMP)
	$(PY) -m ckpt_cli.completions completions

# every benchmark with its defaults (several minutes, a few GB of scratch data); see bench/README.md
bench: $(STAMP)
	for script in bench/*.py; do echo "== $$script"; PYTHONPATH=$(CURDIR) $(PY) $$script || exit 1; done

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
