# pt-multi-gpu. `make help` lists the targets. The venv is made on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
ARGS ?=
# The docker tier's selection: everything but `build.py repro`'s two cold builds on Docker 28 and
# `verify --rebuild`'s build, signed publish and cold rebuild (20 to 36 minutes for both on 2 cores,
# measured), over the tier's budget (docs/testing.md), which `make test-repro` runs.
DOCKER_MARKERS ?= not repro
# Platforms of the cells to build/test (--platforms): native (default: this host's), all, linux/arm64.
# Other platforms build under qemu emulation (much slower); `make test` covers them all.
PLATFORMS ?=
PLATFORM_FLAG := $(if $(PLATFORMS),--platforms $(PLATFORMS))
EMULATION := $(if $(filter-out native,$(PLATFORMS)),emulation)
# Release sources of enroot and pyxis, which `scripts/ensure-tools.sh test` builds into /usr/local
# (scripts/ensure-hpc-runtimes.sh): ../shared/thirdparty when that folder exists.
PTMG_THIRDPARTY_DIR ?= $(abspath $(wildcard ../shared/thirdparty))
export PTMG_THIRDPARTY_DIR

.DEFAULT_GOAL := help
.PHONY: help images test test-unit test-modern-engine test-repro mutants render check lint engine tools base doctor matrix smoke publish pictures clean gpu-acceptance

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

venv: $(VENV)/.installed ## create or update the virtualenv (.venv)

engine: ## make sure a Docker engine answers (starts dockerd as root on Debian)
	@scripts/ensure-docker.sh

tools: ## install what the docker test tier drives (as root on Debian; elsewhere: says what is missing)
	@scripts/ensure-tools.sh test

images: $(VENV)/.installed engine ## build the images of images.yaml for this host (PLATFORMS=all: arm64 too, emulated; ARGS="--only PATTERN --jobs 2 ...")
	@scripts/ensure-tools.sh images $(EMULATION)
	$(PY) build.py build $(PLATFORM_FLAG) $(ARGS)

base: $(VENV)/.installed engine ## make the base images offline with debootstrap where they can't be pulled
	@scripts/ensure-tools.sh images $(EMULATION)
	$(PY) build.py base $(PLATFORM_FLAG) $(ARGS)

smoke: $(VENV)/.installed engine ## smoke-test the built images in containers (ARGS="--nodes 2" for multi-node DDP)
	$(PY) build.py test $(PLATFORM_FLAG) $(ARGS)

publish: $(VENV)/.installed engine ## push built, smoke-tested images: make publish REGISTRY=host[:port][/namespace]
	@test -n "$(REGISTRY)" || { echo "usage: make publish REGISTRY=host[:port][/namespace]" >&2; exit 2; }
	$(PY) build.py publish --registry "$(REGISTRY)" $(ARGS)

pictures: $(VENV)/.installed engine ## regenerate docs/img/ (screenshots + size chart) from real runs of the latest image
	$(PY) scripts/pictures.py $(ARGS)

# The host's python (torch, Triton, pytest, nvcc), not the venv: no image, no Docker, no network.
gpu-acceptance: ## every GPU check in one go on a bare GPU host, <= 540 s (one 10-min call); report in $(OUT) or gpu-acceptance/ (ARGS="--dry-run")
	scripts/gpu-acceptance.sh $(ARGS)

doctor: $(VENV)/.installed ## check this host: engine, BuildKit, disk, GPUs, driver per cell
	$(PY) build.py doctor $(ARGS)

matrix: $(VENV)/.installed ## show the validated matrix
	$(PY) build.py matrix $(ARGS)

render: $(VENV)/.installed ## render docker/<cell>/Dockerfile and the README table from images.yaml
	$(PY) build.py render

check: $(VENV)/.installed ## fail if the committed Dockerfiles drift from images.yaml
	$(PY) build.py render --check

lint: $(VENV)/.installed ## ruff, mypy --strict and hadolint on every rendered Dockerfile
	$(BIN)/ruff check .
	MYPY=$(BIN)/mypy scripts/typecheck.sh
	$(PY) build.py render --check
	$(PY) build.py lock --check
	$(BIN)/hadolint --config .hadolint.yaml docker/*/Dockerfile

# The unit tier runs on every core (pytest-xdist); the docker tier in one process, in order
# (its session fixtures build, start and remove real images, registries and clusters).
UNIT := $(PY) -m pytest -n auto tests/unit

test-unit: $(VENV)/.installed ## unit tests only (no Docker engine; a registry on loopback; a few minutes)
	@scripts/ensure-tools.sh unit
	$(UNIT) $(ARGS)

test: $(VENV)/.installed engine tools ## everything: lint, unit tests, then real builds and containers
	$(MAKE) --no-print-directory lint
	@# ARGS goes to both tiers (as it did when they were one run): a tier it selects nothing from
	@# (pytest's exit 5) is fine, both are not.
	@unit=0; docker=0; \
	$(UNIT) $(ARGS) || unit=$$?; \
	[ $$unit = 0 ] || [ $$unit = 5 ] || exit $$unit; \
	$(PY) -m pytest --durations=25 tests/docker -m "$(DOCKER_MARKERS)" $(ARGS) || docker=$$?; \
	[ $$docker = 0 ] || [ $$docker = 5 ] || exit $$docker; \
	[ $$unit$$docker != 55 ] || { echo "make test: ARGS=$(ARGS) selects no test" >&2; exit 5; }

test-modern-engine: $(VENV)/.installed engine tools ## the docker tier's Docker 28 tests alone (a second engine, both image stores; also in `make test`; ~20 min)
	$(PY) -m pytest --durations=25 tests/docker -m modern_engine $(ARGS)

test-repro: $(VENV)/.installed engine tools ## `build.py repro`'s two cold builds and `verify --rebuild`'s build + cold rebuild on Docker 28's containerd store (20-36 min; not in `make test`)
	$(PY) -m pytest --durations=25 tests/docker -m repro $(ARGS)

# Mutation testing of the safety modules (scripts/mutants_plan.py), cosmic-ray pinned in
# requirements-mutants.txt and installed on first use. SCOPE=changed: only the modules (or their
# tests) that differ from main. JOBS mutants at once, each in its own scratch copy of the tree.
SCOPE ?= all
JOBS ?= 2
$(VENV)/.mutants-installed: requirements-mutants.txt $(VENV)/.installed
	$(PY) -m pip install -q -r requirements-mutants.txt
	@touch $@

mutants: $(VENV)/.mutants-installed ## mutation testing of the safety modules, report in build-logs/mutants.txt (SCOPE=changed, JOBS=2)
	$(PY) scripts/mutants.py --scope $(SCOPE) --jobs $(JOBS) $(ARGS)

clean: ## remove the venv and test artifacts (images stay; see `docker image ls pt-multi-gpu`)
	rm -rf $(VENV) test-artifacts .pytest_cache .mypy_cache .ruff_cache
