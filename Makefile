# Two commands, each does its own set-up on a fresh machine:
#   make demo   a tensor-parallel block whose all-reduce is autotuned on 2 gloo ranks
#   make test   the test suite (multi-process, real gloo process groups)
# Afterwards .venv/bin/python and .venv/bin/torchrun are the patched environment
# (torch 2.14.1, vLLM's pin, from this machine's disk). Each torch a user runs has a lane:
#   .venv-2.15  2.15.0  the newest release, what `pip install torch` gives: every
#                       test, on 2 and 4 ranks
#   .venv       2.14.1  vLLM 0.33's pin (the default)  } the overlay, the contracts,
#   .venv-2.13  2.13.0  SGLang's, TensorRT-LLM's pin   } the units, the dynamic-size
#   .venv-2.11  2.11.0  the GPU machines' torch        } tests, upstream's test patterns,
#                                                      } ops that do not communicate

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH ?= 2.14.1
VENV_213 := .venv-2.13
VPY_213 := $(VENV_213)/bin/python
VENV_211 := .venv-2.11
VPY_211 := $(VENV_211)/bin/python
VENV_215 := .venv-2.15
VPY_215 := $(VENV_215)/bin/python
NPROC ?= 2

.PHONY: demo test test-vllm vllm-lane lint venvs test-2.15-rest test-2.14 test-2.13 test-2.11 test-older-minors overlay unoverlay gpu-demo gpu-test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet torch==$(TORCH) numpy pytest expecttest ruff
	touch $@

$(VENV_213)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_213)
	$(VPY_213) -m pip install --quiet torch==2.13.0 numpy pytest expecttest
	touch $@

# torch 2.11's lane runs on the CPU, where the CUDA libraries that `import torch` loads are
# never called: it takes torch's wheel without them (nor triton, which the CPU backend does
# not use; the 2.13 lane's CPU build has neither) and finds .venv's, whose sonames 2.11's
# torch links (same CUDA 13 packages, newer patch releases). About 3.3 GB less on disk.
CUDA_LIBRARIES = $(VENV_211)/cuda-libraries
$(VENV_211)/.installed: pyproject.toml $(VENV)/.installed
	rm -rf $(VENV_211)
	$(PYTHON) -m venv $(VENV_211)
	$(VPY_211) -m pip install --quiet --no-deps torch==2.11.0
	$(VPY_211) -m pip install --quiet filelock fsspec jinja2 networkx setuptools sympy \
		typing-extensions numpy pytest expecttest
	mkdir -p $(CUDA_LIBRARIES)
	ln -s $(abspath $(shell $(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'))/nvidia \
		$(CUDA_LIBRARIES)/nvidia
	echo $(abspath $(CUDA_LIBRARIES)) \
		> $$($(VPY_211) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/cuda_libraries.pth
	$(VPY_211) -c 'import torch; assert torch.__version__.startswith("2.11.0"), torch.__version__'
	touch $@

# vLLM as users install it, on the project's torch: `pip install --no-deps vllm==0.33.0`
# plus the packages its compile path imports (pinned in the requirements file). Its own
# venv, layered on .venv: a .pth adds .venv's site-packages (torch with the overlay
# applied, pytest) after its own, so .venv stays what `pip install torch` gives and no
# second torch (about 4 GiB) is installed. vLLM pins torch 2.14.0; .venv has 2.14.1.
VLLM_VERSION := 0.33.0
VENV_VLLM := .venv-vllm
VPY_VLLM := $(VENV_VLLM)/bin/python
VLLM_REQUIREMENTS := tools/vllm-$(VLLM_VERSION)-requirements.txt

$(VENV_VLLM)/.installed: $(VENV)/.installed $(VLLM_REQUIREMENTS)
	rm -rf $(VENV_VLLM)
	$(PYTHON) -m venv $(VENV_VLLM)
	echo "import site; site.addsitedir('$(abspath $(shell $(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'))')" \
		> $$($(VPY_VLLM) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/project_venv.pth
	$(VPY_VLLM) -m pip install --quiet --no-deps vllm==$(VLLM_VERSION) -r $(VLLM_REQUIREMENTS)
	touch $@

# torch 2.15 comes from PyPI, above the cap this machine's pip config sets (torch
# <=2.14.1, the releases on its disk): the cap is lifted for this one command. PyPI's
# Linux wheel is the CUDA build (about 3 GB with its CUDA libraries; no CPU build).
$(VENV_215)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_215)
	PIP_CONSTRAINT=/dev/null $(VPY_215) -m pip install --quiet torch==2.15.0 numpy pytest expecttest
	touch $@

# Applying is idempotent and cheap; run it every time so a changed diff takes effect.
overlay: $(VENV)/.installed
	$(VPY) tools/overlay.py --python $(VPY) apply

# overlay-2.15, overlay-2.13, overlay-2.11
overlay-%: .venv-%/.installed
	.venv-$*/bin/python tools/overlay.py --python .venv-$*/bin/python apply

unoverlay:
	$(VPY) tools/overlay.py --python $(VPY) remove

demo: overlay
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) examples/tp_allreduce/demo.py

# Inductor's CPU backend checks each vector ISA the CPU lists by building a probe and
# loading it in a fresh Python (an `import torch`, seconds here) once per process: each
# spawned rank paid up to 30 s for it on torch 2.11. The tests take the ISAs as the CPU
# lists them (gcc 12 builds each); a value set by the caller wins. The demo and the GPU
# targets keep Inductor's default.
test test-2.15-rest test-2.14 test-2.13 test-2.11 test-vllm vllm-lane: export TORCHINDUCTOR_VEC_ISA_OK ?= 1
# Each rank's compile would start a pool of compile workers, each importing torch anew:
# on 2 cores they cost more CPU than they save. A value set by the caller wins.
test test-2.15-rest test-2.14 test-2.13 test-2.11 test-vllm vllm-lane: export TORCHINDUCTOR_COMPILE_THREADS ?= 1
# The files whose tests run on ranks: under torchrun every process is a rank and each
# test's body runs in it (cases of another world size skip there). Their tests that use
# no rank are marked single_process and skip under torchrun.
RANK_TESTS = $(shell grep -l run_ranks test/inductor/test_collective_op_tuning*.py)

# A fresh CI machine's disk is small and wheels may download: no pip cache (each wheel
# installs once), and the two CUDA builds one after the other (each holds its downloaded
# wheels, about 3 GB, until it is installed), then the small venvs side by side.
# About 14 GB in all. A value set by the caller wins.
export PIP_NO_CACHE_DIR ?= 1
venvs:
	$(MAKE) $(VENV)/.installed
	$(MAKE) $(VENV_215)/.installed
	$(MAKE) -j3 $(VENV_213)/.installed $(VENV_211)/.installed $(VENV_VLLM)/.installed

# Upstream's formatter and lint rules (pyproject.toml's [tool.ruff], as pytorch/pytorch's).
LINTED := torch tools test benchmarks examples
lint: $(VENV)/.installed
	$(VPY) -m ruff format --check $(LINTED)
	$(VPY) -m ruff check $(LINTED)

# Each torch runs its rank tests under torchrun first (processes that live for the whole
# lane: no spawn and `import torch` per test), then what is left self-spawned: a test
# that passed on every rank of a torchrun run is not run again
# (test/inductor/collective_lanes.py; plain `pytest test` runs everything).
PASSED := build/test-passed
PYTEST := -m pytest -q -p no:cacheprovider --durations=10
# $(1) venv, $(2) its record folder, $(3) world size, $(4) test files, $(5) -k filter.
ranks = COLLECTIVE_TESTS_RECORD_PASSED=$(PASSED)/$(2)/$(3) $(1)/bin/torchrun \
	--standalone --nproc_per_node=$(3) $(PYTEST) $(4) $(if $(5),-k "$(5)")
# $(1) venv, $(2) its record folder, $(3) test files, $(4) -k filter.
rest = COLLECTIVE_TESTS_SKIP_PASSED=$(PASSED)/$(2)/2:$(PASSED)/$(2)/4 \
	$(1)/bin/python $(PYTEST) $(3) $(if $(4),-k "$(4)")

# Lint; torch 2.15's rank tests on 2 and 4 gloo ranks (the newest release runs every
# test); then its self-spawned rest beside the 2.14, 2.13 and 2.11 lanes, one after the
# other: much of the rest waits (timeouts, killed ranks, restarts), and the lanes share
# no state (each torchrun on a free port). A lane added to BESIDE_REST runs beside them.
BESIDE_REST := test-older-minors vllm-lane
test: venvs
	$(MAKE) lint overlay overlay-2.15 overlay-2.13 overlay-2.11
	rm -rf $(PASSED)/2.15
	$(call ranks,$(VENV_215),2.15,2,$(RANK_TESTS),)
	$(call ranks,$(VENV_215),2.15,4,$(RANK_TESTS),)
	$(MAKE) -j$(words test-2.15-rest $(BESIDE_REST)) --output-sync=target \
		test-2.15-rest $(BESIDE_REST)

test-2.15-rest:
	$(call rest,$(VENV_215),2.15,test,)

test-older-minors:
	$(MAKE) test-2.14
	$(MAKE) test-2.13
	$(MAKE) test-2.11

# vLLM 0.33.0's own compile pipeline on gloo ranks, self-spawned (its jobs restart on
# shared caches), from .venv-vllm on vLLM's torch minor (2.14). In `make test` it runs
# beside 2.15's rest.
test-vllm: overlay $(VENV_VLLM)/.installed
	$(MAKE) vllm-lane

vllm-lane:
	$(VPY_VLLM) $(PYTEST) test/inductor/test_collective_op_tuning_vllm.py

# What the older minors run: the overlay's round trip, the upstream contracts, the
# units, the size dispatch, upstream's test patterns, ops that do not communicate (by
# name, or by an argument that names no group), the knob switched off (torch 2.11 lowers
# such an op itself), and the user's group after a hung choice (c10d's group API).
MINOR_TESTS := test/tools/test_overlay.py test/distributed/test_store_session.py \
	$(wildcard test/inductor/test_collective_op_tuning_units_*.py) \
	test/inductor/test_collective_op_tuning_contracts.py \
	test/inductor/test_collective_op_tuning_graphs.py \
	test/inductor/test_collective_op_tuning_conformance.py \
	test/inductor/test_collective_op_tuning_noncollective.py \
	test/inductor/test_collective_op_tuning.py \
	test/inductor/test_collective_op_tuning_failing_choices.py
# Four ranks run on 2.15 only.
MINOR_SELECT := (overlay or StoreSession or contract or units or dynamic or split or mix or each_size_range or warm_up_compiles or reads_its_size or Upstream or noncollective or non_collective_op or naming_no_group or users_group_still_works or switched_off or one_winner) and not world_size_4

MINOR_RANK_TESTS = $(filter $(RANK_TESTS),$(MINOR_TESTS))

# $(1) venv, $(2) minor: the minors' selection, its rank tests under torchrun on 2 ranks
# first, then the rest self-spawned.
define minor_lane
	rm -rf $(PASSED)/$(2)
	$(call ranks,$(1),$(2),2,$(MINOR_RANK_TESTS),$(MINOR_SELECT))
	$(call rest,$(1),$(2),$(MINOR_TESTS),$(MINOR_SELECT))
endef

test-2.14: overlay
	$(call minor_lane,$(VENV),2.14)

test-2.13 test-2.11: test-%: overlay-%
	$(call minor_lane,.venv-$*,$*)

# On a GPU machine whose system python3 already has torch (no network, no venv).
gpu-demo:
	python3 tools/overlay.py --python python3 apply
	torchrun --nproc_per_node=$(NPROC) examples/tp_allreduce/demo.py --device cuda

gpu-test:
	python3 tools/overlay.py --python python3 apply
	torchrun --nproc_per_node=$(NPROC) -m pytest test -q
