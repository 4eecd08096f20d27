# Two commands, each does its own set-up on a fresh machine:
#   make demo   a tensor-parallel block whose all-reduce is autotuned on 2 gloo ranks
#   make test   the test suite (multi-process, real gloo process groups)
# Afterwards .venv/bin/python and .venv/bin/torchrun are the patched environment
# (torch 2.14.1, what `pip install torch` gives here); .venv-2.13 holds torch 2.13.0,
# on which the overlay, the contracts and the dynamic-size tests run too.

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH ?= 2.14.1
VENV_213 := .venv-2.13
VPY_213 := $(VENV_213)/bin/python
NPROC ?= 2

.PHONY: demo test test-2.13 overlay overlay-2.13 unoverlay gpu-demo gpu-test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet torch==$(TORCH) numpy pytest
	touch $@

$(VENV_213)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_213)
	$(VPY_213) -m pip install --quiet torch==2.13.0 numpy pytest
	touch $@

# Applying is idempotent and cheap; run it every time so a changed diff takes effect.
overlay: $(VENV)/.installed
	$(VPY) tools/overlay.py --python $(VPY) apply

overlay-2.13: $(VENV_213)/.installed
	$(VPY_213) tools/overlay.py --python $(VPY_213) apply

unoverlay:
	$(VPY) tools/overlay.py --python $(VPY) remove

demo: overlay
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) examples/tp_allreduce/demo.py

# Self-spawning first, then the same file with every process a rank of torchrun
# (cases of another world size skip there); then torch 2.13.
test: overlay test-2.13
	$(VPY) -m pytest test -q
	$(VENV)/bin/torchrun --nproc_per_node=2 -m pytest test -q -p no:cacheprovider
	$(VENV)/bin/torchrun --nproc_per_node=4 -m pytest test -q -p no:cacheprovider

# On torch 2.13: the overlay's round trip, the upstream contracts, the size dispatch.
test-2.13: overlay-2.13
	$(VPY_213) -m pytest -q -p no:cacheprovider test/inductor/test_collective_autotuning_overlay.py \
		test/inductor/test_collective_autotuning_contracts.py test/inductor/test_collective_autotuning_units.py \
		test/inductor/test_collective_autotuning_graphs.py -k "overlay or contract or units or dynamic or split or mix"

# On a GPU machine whose system python3 already has torch (no network, no venv).
gpu-demo:
	python3 tools/overlay.py --python python3 apply
	torchrun --nproc_per_node=$(NPROC) examples/tp_allreduce/demo.py --device cuda

gpu-test:
	python3 tools/overlay.py --python python3 apply
	torchrun --nproc_per_node=$(NPROC) -m pytest test -q
