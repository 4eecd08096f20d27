# Two commands, each does its own set-up on a fresh machine:
#   make demo   a tensor-parallel block whose all-reduce is autotuned on 2 gloo ranks
#   make test   the test suite (multi-process, real gloo process groups)
# Afterwards .venv/bin/python and .venv/bin/torchrun are the patched environment
# (torch 2.14.1, what `pip install torch` gives here); .venv-2.13 and .venv-2.11 hold
# torch 2.13.0 and 2.11.0 (the GPU machines' torch), on which the overlay, the
# contracts, the dynamic-size tests, upstream's test patterns and the check that ops
# which do not communicate are untouched run too.

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH ?= 2.14.1
VENV_213 := .venv-2.13
VPY_213 := $(VENV_213)/bin/python
VENV_211 := .venv-2.11
VPY_211 := $(VENV_211)/bin/python
NPROC ?= 2

.PHONY: demo test lint venvs test-2.13 test-2.11 overlay overlay-2.13 overlay-2.11 unoverlay gpu-demo gpu-test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet torch==$(TORCH) numpy pytest expecttest ruff
	touch $@

$(VENV_213)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_213)
	$(VPY_213) -m pip install --quiet torch==2.13.0 numpy pytest expecttest
	touch $@

$(VENV_211)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_211)
	$(VPY_211) -m pip install --quiet torch==2.11.0 numpy pytest expecttest
	touch $@

# Applying is idempotent and cheap; run it every time so a changed diff takes effect.
overlay: $(VENV)/.installed
	$(VPY) tools/overlay.py --python $(VPY) apply

overlay-2.13: $(VENV_213)/.installed
	$(VPY_213) tools/overlay.py --python $(VPY_213) apply

overlay-2.11: $(VENV_211)/.installed
	$(VPY_211) tools/overlay.py --python $(VPY_211) apply

unoverlay:
	$(VPY) tools/overlay.py --python $(VPY) remove

demo: overlay
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) examples/tp_allreduce/demo.py

# Inductor's CPU backend checks each vector ISA the CPU lists by building a probe and
# loading it in a fresh Python (an `import torch`, seconds here) once per process: each
# spawned rank paid up to 30 s for it on torch 2.11. The tests take the ISAs as the CPU
# lists them (gcc 12 builds each); a value set by the caller wins. The demo and the GPU
# targets keep Inductor's default.
test test-2.13 test-2.11: export TORCHINDUCTOR_VEC_ISA_OK ?= 1
# Under torchrun, the files whose tests run on the job's ranks (cases of another world
# size skip there). The others (units, contracts, the overlay, ops that do not
# communicate) use no rank: under torchrun each rank would run them again, side by
# side, testing nothing more, for a third of the CI's time.
RANK_TESTS = $(shell grep -l run_ranks test/inductor/test_collective_op_tuning*.py)

# The three torches install side by side (a minute each, mostly unpacking wheels).
venvs:
	$(MAKE) -j3 $(VENV)/.installed $(VENV_213)/.installed $(VENV_211)/.installed

# Upstream's formatter and lint rules (pyproject.toml's [tool.ruff], as pytorch/pytorch's).
LINTED := torch tools test benchmarks examples
lint: $(VENV)/.installed
	$(VPY) -m ruff format --check $(LINTED)
	$(VPY) -m ruff check $(LINTED)

# Lint; torch 2.13 and 2.11; the rank tests with every process a rank of torchrun (2,
# then 4 ranks); then every other test self-spawning: a test that passed on every rank
# of a torchrun lane is not spawned again (test/conftest.py; `pytest test` alone runs
# them all).
PASSED := build/test-passed
test: venvs lint overlay test-2.13 test-2.11
	rm -rf $(PASSED)
	COLLECTIVE_TESTS_RECORD_PASSED=$(PASSED)/2 $(VENV)/bin/torchrun --nproc_per_node=2 -m pytest $(RANK_TESTS) -q -p no:cacheprovider
	COLLECTIVE_TESTS_RECORD_PASSED=$(PASSED)/4 $(VENV)/bin/torchrun --nproc_per_node=4 -m pytest $(RANK_TESTS) -q -p no:cacheprovider
	COLLECTIVE_TESTS_SKIP_PASSED=$(PASSED)/2:$(PASSED)/4 $(VPY) -m pytest test -q

# What the older minors run: the overlay's round trip, the upstream contracts, the size
# dispatch, upstream's test patterns on every rank, ops that do not communicate, the
# knob switched off (torch 2.11 lowers such an op itself).
MINOR_TESTS := test/tools/test_overlay.py test/distributed/test_store_session.py \
	test/inductor/test_collective_op_tuning_contracts.py test/inductor/test_collective_op_tuning_units.py \
	test/inductor/test_collective_op_tuning_graphs.py test/inductor/test_collective_op_tuning_conformance.py \
	test/inductor/test_collective_op_tuning_noncollective.py test/inductor/test_collective_op_tuning.py
MINOR_SELECT := overlay or StoreSession or contract or units or dynamic or split or mix or each_size_range or warm_up_compiles or reads_its_size or Upstream or noncollective or switched_off or one_winner

test-2.13: overlay-2.13
	$(VPY_213) -m pytest -q -p no:cacheprovider $(MINOR_TESTS) -k "$(MINOR_SELECT)"

test-2.11: overlay-2.11
	$(VPY_211) -m pytest -q -p no:cacheprovider $(MINOR_TESTS) -k "$(MINOR_SELECT)"

# On a GPU machine whose system python3 already has torch (no network, no venv).
gpu-demo:
	python3 tools/overlay.py --python python3 apply
	torchrun --nproc_per_node=$(NPROC) examples/tp_allreduce/demo.py --device cuda

gpu-test:
	python3 tools/overlay.py --python python3 apply
	torchrun --nproc_per_node=$(NPROC) -m pytest test -q
