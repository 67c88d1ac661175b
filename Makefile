# Every target sets itself up: a fresh machine needs only python3 (3.10+) and a C++ compiler.
PY      ?= python3
VENV    ?= .venv
VPY      = $(VENV)/bin/python
TORCH   ?= torch==2.14.1
NPROC   ?= 2

.PHONY: help venv build test test-slow test-all soak stream-check cuda-check gpu-check train train-smoke bench clean
.DEFAULT_GOAL := help

# The list is read from the `## ` note on each target's line, so a new target documents itself.
help: ## this list (also what a bare `make` prints)
	@echo "make TARGET, for one of these (each sets up what it needs first: .venv, the extension):"
	@awk 'BEGIN { FS = ":.*## " } /^[a-z][a-z-]*:.*## / { printf "  %-13s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)
	@echo "Settings: NPROC=$(NPROC) (compile jobs), FSDP_EXT_CUDA=auto|0|1 (CUDA kernels), SLOW_BUDGET_S, ESSENTIAL_BUDGET_S, SOAK_STEPS; README.md and docs/testing.md say more."

$(VENV)/.installed: pyproject.toml setup.py Makefile
	@echo "== set-up 1/2: $(VENV) with $(TORCH) (5.5 GB with its CUDA libraries; 6.5 GB in all) and the test and example dependencies (about 2 minutes on idle cores, pip's cache warm)"
	@start=$$(date +%s); \
	$(PY) -m venv $(VENV) && \
	$(VPY) -m pip install -q --upgrade pip && \
	$(VPY) tools/pip_progress.py --log $(VENV)/install.log -- \
	  $(VPY) -m pip install "$(TORCH)" ninja pybind11 pytest numpy setuptools wheel hypothesis safetensors tqdm transformers matplotlib && \
	echo "== installed in $$(( $$(date +%s) - start )) s (pip's whole output: $(VENV)/install.log)"
	touch $@

venv: $(VENV)/.installed ## the virtual environment only: torch and the test and example dependencies

# Builds fsdp_ext._C in place, with the integrations' extras (accelerate, Lightning), torchao
# (tensor-subclass parameters) and torchtitan (its trainer as a test client) for their tests.
# CPU kernels always. CUDA kernels only where they can run: FSDP_EXT_CUDA=auto (default) builds them
# when `nvidia-smi -L` lists a GPU (and setup.py finds nvcc and a CUDA torch); 1 forces them, 0 skips
# them. Without a GPU nothing could run them and `make cuda-check` compiles every .cu file anyway;
# skipping them saves about 30 s of the build here (docs/testing.md has the measurements).
# Rebuilt only when a source changes. pip runs with -v into $(VENV)/build.log; tools/pip_progress.py
# prints a line per compiled file instead, so the minutes of compiling are not silent.
FSDP_EXT_CUDA ?= auto
BUILD_CUDA = $(if $(filter auto,$(FSDP_EXT_CUDA)),$(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0),$(FSDP_EXT_CUDA))
BUILT = $(VENV)/.built
$(BUILT): $(VENV)/.installed setup.py $(wildcard csrc/*.h csrc/*.cpp csrc/cpu/*.cpp csrc/cuda/*.cu)
	@if [ "$(BUILD_CUDA)" = 1 ]; then \
	  echo "== set-up 2/2: building fsdp_ext._C: C++ kernels (csrc/*.cpp, csrc/cpu/*.cpp) and CUDA kernels (csrc/cuda/*.cu): about 3 minutes on 2 idle cores"; \
	else \
	  echo "== set-up 2/2: building fsdp_ext._C: C++ kernels (csrc/*.cpp, csrc/cpu/*.cpp) and the extras: about 2 minutes on 2 idle cores; CUDA kernels skipped (no GPU; FSDP_EXT_CUDA=1 builds them)"; \
	fi
	@start=$$(date +%s); \
	FSDP_EXT_NO_CUDA=$(if $(filter 1,$(BUILD_CUDA)),0,1) MAX_JOBS=$(NPROC) \
	  $(VPY) tools/pip_progress.py --log $(VENV)/build.log -- \
	  $(VPY) -m pip install -v --no-build-isolation -e ".[accelerate,lightning,torchao,titan]" && \
	echo "== built in $$(( $$(date +%s) - start )) s (pip's whole output: $(VENV)/build.log)"
	touch $@

build: $(BUILT) ## the venv, then fsdp_ext._C (C++ kernels; CUDA ones where a GPU is seen) and the optional extras

# The default test suite (CPU only; CUDA tests skip without a GPU): progress by file, then the
# slowest tests. Fits 12 minutes on an idle 2-core machine; larger world sizes, torch.compile of a
# whole model, the GPU compile of the Triton kernels and benchmark smokes are marked slow.
PYTEST_REPORT = -o console_output_style=count --durations=15 --durations-min=2
test: build ## the default test suite (CPU; GPU-only, slow and stream-order cases skip, counted by reason)
	$(VPY) -m pytest -x $(PYTEST_REPORT) tests

# The cases marked slow (the soak has its own target). SLOW_BUDGET_S=N runs the cases marked
# essential first (a client or a fault path) and skips, saying so, every other test that would
# start after N seconds; an essential one that would start after ESSENTIAL_BUDGET_S (default N)
# fails the run: how CI runs them within its time.
SLOW_BUDGET_S ?=
ESSENTIAL_BUDGET_S ?=
test-slow: build ## the cases marked slow (SLOW_BUDGET_S=N skips those that would start after N s)
	$(VPY) -m pytest $(PYTEST_REPORT) --durations=0 -m slow --runslow --ignore=tests/end_to_end/test_soak.py tests \
		$(if $(SLOW_BUDGET_S),--budget-s $(SLOW_BUDGET_S)) \
		$(if $(ESSENTIAL_BUDGET_S),--essential-budget-s $(ESSENTIAL_BUDGET_S))

# Everything: the default suite, the slow cases, the stream-order scenarios, the soak at 300 steps,
# and the exhaustive sweeps (every float32 bit pattern through the quantized kernels: ~15 minutes).
test-all: build ## every case: the default suite, the slow cases, the stream-order scenarios, the soak, the exhaustive sweeps
	$(VPY) -m pytest $(PYTEST_REPORT) --runslow --exhaustive tests

# The soak test on a short budget (world 4, CPU): SOAK_STEPS steps with random micro-batch counts,
# periodic checkpoints, losses against a reference, no memory growth. test-all runs 300 steps.
SOAK_STEPS ?= 100
soak: build ## the soak test at world 4 for SOAK_STEPS steps (default 100)
	FSDP_EXT_SOAK_STEPS=$(SOAK_STEPS) $(VPY) -m pytest -q tests/end_to_end/test_soak.py --runslow

# The runtime's side-stream (GPU) path on CPU under the stream-order model: races, early frees and
# host syncs across every sharding strategy, prefetch depth, no_sync, offload, HSDP, mixed
# precision, ...; then the host syncs per steady-state step, by call site.
stream-check: build ## the GPU (side-stream) path on CPU under the stream-order model, then host syncs per step
	rm -f out/stream-check/syncs_w*.json
	$(VPY) -m pytest -q tests/diagnostics/test_stream_check.py \
		tests/end_to_end/test_reliability.py::test_divergence_raises_on_every_rank_with_device_tags \
		tests/end_to_end/test_reliability.py::test_host_wait_count_fails_on_a_planted_wait --stream-check
	$(VPY) -m fsdp_ext.diagnostics.host_syncs out/stream-check/syncs_w*.json

# Compile-checks the CUDA sources with nvcc (no GPU needed).
cuda-check: venv ## compile-checks csrc/cuda/*.cu with nvcc (no GPU needed)
	$(VPY) tools/cuda_check.py

# The checks to run on a machine with CUDA GPUs (kernels, NCCL runtime, delayed side streams, main
# job, GPU benchmark tables); without a GPU it says so and exits 0.
gpu-check: build ## on a CUDA machine: kernels, NCCL runtime, main job, GPU benchmarks (else says so)
	$(VPY) tools/gpu_check.py

# The main job: a GPT trained with fsdp_ext on 2 CPU ranks (gloo), 58 s on 2 idle cores once built.
train: build ## the main job: a GPT trained with fsdp_ext on 2 CPU ranks, profiled, into out/train
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train.py --profile --out-dir out/train

# The main job at a reduced size, for CI.
train-smoke: build ## the main job at a reduced size (5 steps), into out/smoke
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train.py --steps 5 --n-layer 2 --d-model 64 \
		--profile --out-dir out/smoke

bench: build ## the kernel benchmark table (benchmarks/kernels)
	$(VPY) -m benchmarks.kernels.bench_kernels

clean: ## removes the build's outputs (the next target that needs the extension rebuilds it); keeps .venv
	rm -rf build *.egg-info fsdp_ext/_C*.so $(BUILT)
