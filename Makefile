# Every target sets itself up: a fresh machine needs only python3 (3.10+) and a C++ compiler.
PY      ?= python3
VENV    ?= .venv
VPY      = $(VENV)/bin/python
TORCH   ?= torch==2.14.1
NPROC   ?= 2

.PHONY: venv build test test-all soak stream-check cuda-check gpu-check train train-smoke bench clean

$(VENV)/.installed: pyproject.toml setup.py Makefile
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)" ninja pybind11 pytest numpy setuptools wheel hypothesis safetensors tqdm transformers matplotlib
	touch $@

venv: $(VENV)/.installed

# Builds fsdp_ext._C in place (CPU kernels always; CUDA kernels when nvcc and a CUDA torch exist,
# unless FSDP_EXT_NO_CUDA=1), with the integrations' extras (accelerate, Lightning) for their tests. Rebuilt only when a source changes: a CUDA build takes minutes.
BUILT = $(VENV)/.built
$(BUILT): $(VENV)/.installed setup.py $(wildcard csrc/*.h csrc/*.cpp csrc/cpu/*.cpp csrc/cuda/*.cu)
	MAX_JOBS=$(NPROC) $(VPY) -m pip install -q --no-build-isolation -e ".[accelerate,lightning]"
	touch $@

build: $(BUILT)

# The test suite (CPU only; CUDA tests skip without a GPU).
test: build
	$(VPY) -m pytest -q -x tests

test-all: build
	$(VPY) -m pytest -q tests --runslow

# The soak test on a short budget (world 4, CPU): SOAK_STEPS steps with random micro-batch counts,
# periodic checkpoints, losses against a reference, no memory growth. test-all runs 300 steps.
SOAK_STEPS ?= 100
soak: build
	FSDP_EXT_SOAK_STEPS=$(SOAK_STEPS) $(VPY) -m pytest -q tests/test_soak.py --runslow

# The runtime's side-stream (GPU) path on CPU under the stream-order model: races and early frees
# across every sharding strategy, prefetch depth, no_sync, offload, HSDP, mixed precision, ...
stream-check: build
	$(VPY) -m pytest -q tests/test_stream_check.py --stream-check

# Compile-checks the CUDA sources with nvcc (no GPU needed).
cuda-check: venv
	$(VPY) tools/cuda_check.py

# The checks to run on a machine with CUDA GPUs (kernels, NCCL runtime, delayed side streams, main
# job, GPU benchmark tables); without a GPU it says so and exits 0.
gpu-check: build
	$(VPY) tools/gpu_check.py

# The main job: a GPT trained with fsdp_ext on 2 CPU ranks (gloo), a few minutes.
train: build
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train.py --profile --out-dir out/train

# The main job at a reduced size, for CI.
train-smoke: build
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train.py --steps 5 --n-layer 2 --d-model 64 \
		--profile --out-dir out/smoke

bench: build
	$(VPY) benchmarks/bench_kernels.py

clean:
	rm -rf build *.egg-info fsdp_ext/_C*.so
