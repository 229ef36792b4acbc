# One line per target. `generate` and `test` set up .venv themselves on a fresh machine:
# `generate` (and `check-generated`) install only what the generator needs, the rest install
# what developing needs (torch, the test and lint tools) on top.
VENV := .venv
PY := $(VENV)/bin/python
GEN_STAMP := $(VENV)/.gen-$(shell cat requirements-gen.txt pyproject.toml | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.dev-$(shell cat requirements-gen.txt requirements-dev.txt pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: generate check check-generated lint test demo bench venv clean

generate: $(GEN_STAMP) ; $(PY) -m bufc.codegen generate && $(PY) -m bufc.codegen contract --out docs/contract.md
check: check-generated lint
check-generated: $(GEN_STAMP) ; $(PY) -m bufc.codegen check && $(PY) -m bufc.codegen contract --check docs/contract.md
lint: $(STAMP) ; $(VENV)/bin/ruff check codegen runtime rules requests tests bufc schema bench examples && $(VENV)/bin/ruff format --check codegen runtime rules requests tests bufc schema bench examples && $(VENV)/bin/mypy --ignore-missing-imports codegen runtime rules requests
test: $(STAMP) ; $(PY) -m pytest
demo: $(STAMP) ; $(PY) -m bufc.codegen demo --device $(or $(DEVICE),cpu) --pp $(or $(PP),1) --tp $(or $(TP),1) --backend $(or $(BACKEND),gloo)
bench: $(STAMP) ; $(PY) bench/prepare_step.py --device $(or $(DEVICE),cpu) --json bench/results/$(or $(DEVICE),cpu).json && $(PY) bench/churn.py --device $(or $(DEVICE),cpu) --json bench/results/churn-$(or $(DEVICE),cpu).json
venv: $(STAMP)
$(GEN_STAMP): requirements-gen.txt pyproject.toml ; rm -f $(VENV)/.gen-* && (test -x $(PY) || python3 -m venv $(VENV)) && $(PY) -m pip install -q -r requirements-gen.txt && $(PY) -m pip install -q --no-deps --no-build-isolation -e . && touch $@
$(STAMP): $(GEN_STAMP) requirements-dev.txt ; rm -f $(VENV)/.dev-* && $(PY) -m pip install -q -r requirements-dev.txt && touch $@
clean: ; rm -rf $(VENV) build *.egg-info
