# Two commands, each does its own set-up on a fresh machine:
#   make demo   a tensor-parallel block whose all-reduce is autotuned on 2 gloo ranks
#   make test   the test suite (multi-process, real gloo process groups)
# Afterwards .venv/bin/python and .venv/bin/torchrun are the patched environment.

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: demo test overlay unoverlay gpu-demo gpu-test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet torch==2.13.0 numpy pytest
	touch $@

# Applying is idempotent and cheap; run it every time so a changed diff takes effect.
overlay: $(VENV)/.installed
	$(VPY) tools/overlay.py --python $(VPY) apply

unoverlay:
	$(VPY) tools/overlay.py --python $(VPY) remove

demo: overlay
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) examples/tp_allreduce/demo.py

# Self-spawning first, then the same file with every process a rank of torchrun
# (cases of another world size skip there).
test: overlay
	$(VPY) -m pytest test -q
	$(VENV)/bin/torchrun --nproc_per_node=2 -m pytest test -q -p no:cacheprovider
	$(VENV)/bin/torchrun --nproc_per_node=4 -m pytest test -q -p no:cacheprovider

# On a GPU machine whose system python3 already has torch (no network, no venv).
gpu-demo:
	python3 tools/overlay.py --python python3 apply
	torchrun --nproc_per_node=$(NPROC) examples/tp_allreduce/demo.py --device cuda

gpu-test:
	python3 tools/overlay.py --python python3 apply
	torchrun --nproc_per_node=$(NPROC) -m pytest test -q
