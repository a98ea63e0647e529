# Two commands for a fresh clone: `make demo` and `make test`. Both build .venv from this repo's files.
# Another environment: `make VENV=/path/to/venv ...` installs into that one (created if missing).
PYTHON ?= python3
VENV ?= .venv
# TensorFlow wheel: cpu here, gpu on CUDA hosts (make TF_EXTRA=gpu demo); TF_EXTRA= (empty) keeps the
# TensorFlow the environment already has (a cluster module).
TF_EXTRA ?= cpu
PY := $(VENV)/bin/python
# The tested set for this TensorFlow wheel; TF_EXTRA= (your own TensorFlow) takes the CPU set's other pins.
CONSTRAINTS := requirements/constraints-$(if $(filter gpu,$(TF_EXTRA)),gpu,cpu).txt
# A GPU venv's Horovod all-reduces on the GPU (NCCL); export HOROVOD_GPU_OPERATIONS= to build without.
HOROVOD_GPU_OPERATIONS ?= $(if $(filter gpu,$(TF_EXTRA)),NCCL,)
STAMP := $(VENV)/.installed-$(or $(TF_EXTRA),own-tf)
comma := ,
# examples: scikit-learn, whose digit scans `make demo` trains on; test: pytest (and examples again).
EXTRAS := $(if $(TF_EXTRA),$(TF_EXTRA)$(comma))examples$(comma)test

HOROVOD_STAMP := $(VENV)/.installed-horovod
DALI_STAMP := $(VENV)/.installed-dali
# What `mpicc` is here ("none" without one): Horovod is rebuilt when it changes (OpenMPI installed, removed, updated).
MPI_STATE := $(VENV)/.mpi-state

.PHONY: venv horovod horovod-gpu clang-cuda dali mpi slurm fashion-mnist FORCE demo test test-fast test-slow bench-input bench-fit bench-loop bench-convert bench-scaling bench-netbed soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@# tensorflow-cpu and tensorflow[and-cuda] share a package directory, and Horovod and the DALI plugin are
	@# compiled against the TensorFlow present: a venv holds one of them for good.
	@for other in cpu gpu; do \
	  if [ "$$other" != "$(TF_EXTRA)" ] && [ -n "$(TF_EXTRA)" ] && [ -e "$(VENV)/.installed-$$other" ]; then \
	    echo "make: $(VENV) holds the TensorFlow of TF_EXTRA=$$other; TF_EXTRA=$(TF_EXTRA) needs its own venv:" \
	      "make TF_EXTRA=$(TF_EXTRA) VENV=.venv-$(TF_EXTRA) ... (or make clean first)" >&2; \
	    exit 1; \
	  fi; \
	done
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# Constraints pin every transitive package to the set tested together.
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	touch $@

# Horovod 0.28.1 from source against the installed TensorFlow (~3 min on 2 cores); see README 'Horovod'.
horovod: $(HOROVOD_STAMP)

$(HOROVOD_STAMP): $(STAMP) tools/install_horovod.sh tools/cuda_build_home.sh tools/cuda_fatbinary.py $(MPI_STATE)
	PYTHON=$(PY) CONSTRAINTS=$(CONSTRAINTS) $(if $(HOROVOD_GPU_OPERATIONS),HOROVOD_GPU_OPERATIONS=$(HOROVOD_GPU_OPERATIONS)) \
	  tools/install_horovod.sh
	touch $@

# NVIDIA DALI for data.loader=dali (docs/data.md 'DALI'): tfscale[dali] (~500 MB of CUDA 12 wheels, which also
# run CPU-only), then its TensorFlow plugin, an sdist compiled against the installed TensorFlow (~1 min). Its build
# finds TensorFlow only without build isolation, so the build tools come from the venv (pinned in the constraints).
dali: $(DALI_STAMP)

$(DALI_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[dali]" wheel
	$(PY) -m pip install --quiet --no-build-isolation -c $(CONSTRAINTS) nvidia-dali-tf-plugin-cuda120
	@out=$$($(PY) -c "import nvidia.dali.plugin.tf" 2>&1) || { echo "$$out" >&2; exit 1; }  # TensorFlow's chatter only on failure
	@echo "dali: $$($(PY) -c 'import nvidia.dali; print(nvidia.dali.__version__)') with its TensorFlow plugin"
	touch $@

# Horovod with NCCL in a tensorflow[and-cuda] venv of its own (VENV_GPU, ~7 GB), on any host, GPU or none: the
# `horovod` target with TF_EXTRA=gpu (~5-9 min here). The CUDA toolkit comes from tools/cuda_build_home.sh: a CUDA 12
# `module load cuda` when there is one, else Debian's clang-19 (`make clang-cuda`) as the CUDA compiler over the
# CUDA 12 wheels TensorFlow installed, plus requirements/cuda-build-wheels.txt in $(VENV_GPU)/cuda-build. Either way
# Horovod's CUDA kernels are CUDA 12 code (TensorFlow's archs, sm_60 to sm_90) calling TensorFlow's CUDA 12 runtime:
# they run wherever TensorFlow's CUDA does (NVIDIA driver >= 525). NCCL is the nvidia-nccl-cu12 wheel TensorFlow
# loads. It ends by importing Horovod with hvd.nccl_built() true and, for clang, printing what the extension's CUDA
# calls bind to and which cubins and PTX its fatbin holds (no GPU needed).
VENV_GPU ?= .venv-gpu
horovod-gpu: clang-cuda
	$(MAKE) TF_EXTRA=gpu VENV=$(VENV_GPU) horovod

# Debian's clang-19 (bookworm has 19.1.7), the CUDA compiler of `make horovod-gpu` on a host without a CUDA 12 nvcc.
# Not root / no apt-get: says so and goes on (cuda_build_home.sh then says what else would do).
CUDA_CLANG ?= clang++-19
clang-cuda:
	@if command -v $(CUDA_CLANG) > /dev/null; then echo "clang-cuda: $$($(CUDA_CLANG) --version | head -1)"; \
	elif command -v nvcc > /dev/null && nvcc --version | grep -q 'release 12\.'; then echo "clang-cuda: not needed, a CUDA 12 nvcc is on PATH"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-19 > /dev/null) \
	  || echo "make clang-cuda: apt-get install clang-19 failed"; \
	else echo "make clang-cuda: needs root and apt-get (apt-get install clang-19), or a CUDA 12 nvcc on PATH"; fi

# Rewritten only when its content changes, so that Horovod is rebuilt only then.
$(MPI_STATE): FORCE | $(STAMP)
	@state=$$(command -v mpicc > /dev/null && mpicc --showme:version 2> /dev/null || echo none); \
	if [ "$$(cat $@ 2> /dev/null)" != "$$state" ]; then echo "$$state" > $@; fi

FORCE:

# Debian's OpenMPI (4.1, with PMIx: Slurm's srun --mpi=pmix plugin loads libpmix from libpmix-dev, a dependency
# of libopenmpi-dev) so that `make horovod` builds Horovod with MPI as well as Gloo and the mpirun / srun --mpi=pmix
# tests run. Not root / no apt-get: says so and goes on; Horovod is built with Gloo only and those tests are skipped.
mpi:
	@if command -v mpicc > /dev/null && command -v mpirun > /dev/null; then echo "mpi: $$(mpirun --version | head -1)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev > /dev/null) \
	  || echo "make mpi: apt-get failed; Horovod is built without MPI and the MPI tests will be skipped"; \
	else echo "make mpi: needs root and apt-get (apt-get install openmpi-bin libopenmpi-dev); Horovod is built without MPI"; fi

# Debian's Slurm + munge for tests/test_slurm.py (apt-get install only; the tests start private daemons).
# Not root / no apt-get: says so and goes on; those tests are then reported as skipped with the reason.
slurm:
	tools/slurm_testbed.sh install || echo "make slurm: Slurm not installed; tests/test_slurm.py will be skipped"

# Debian's dataset-fashion-mnist: the real Fashion-MNIST IDX files in /usr/share/datasets/fashion-mnist,
# for the studies (docs/studies/) and tests/test_convert_arrays.py (skipped, saying why, without them).
FASHION_MNIST_DIR := /usr/share/datasets/fashion-mnist
fashion-mnist:
	@if [ -d $(FASHION_MNIST_DIR) ]; then echo "fashion-mnist: $(FASHION_MNIST_DIR) present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist > /dev/null) \
	  || echo "make fashion-mnist: apt-get failed; tests that need Fashion-MNIST will be skipped"; \
	else echo "make fashion-mnist: needs root and apt-get (apt-get install dataset-fashion-mnist); tests that need it will be skipped"; fi

# A tensorflow-cpu venv runs on the CPU on purpose, also on a machine with NVIDIA GPUs, where tfscale would
# otherwise stop, taking it for a GPU job that cannot see its GPUs (docs/gpu.md).
CPU_ON_PURPOSE := $(if $(filter cpu,$(TF_EXTRA)),CUDA_VISIBLE_DEVICES=-1)

demo: venv
	$(CPU_ON_PURPOSE) $(PY) tools/digits_demo.py --workdir=runs/demo

# Two pytest-xdist workers, whole test files to each, the files with the most multi-process tests first
# (tests/conftest.py; docs/testing.md has the figures). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
PYTEST := $(CPU_ON_PURPOSE) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: venv mpi horovod dali slurm fashion-mnist
	$(PYTEST) --durations=20

test-fast: venv
	$(PYTEST) -m "not slow"

test-slow: venv mpi horovod dali slurm fashion-mnist
	$(PYTEST) -m slow

# tfscale's training input (tf.data, and DALI when `make dali` installed it) vs a plain Model-Garden-style pipeline,
# the decode-only ceiling and Keras' image_dataset_from_directory, on real-photo JPEGs (batch 64, 224 px), rounds
# interleaved.
bench-input: venv dali
	test -d runs/photos || $(PY) tools/make_photo_tree.py runs/photos --classes 10 --per_class 200
	grep -qs '"image_format"' runs/photo_shards/manifest-train.json || \
	  $(PY) tools/tfrecord_convert.py --input_dir=runs/photos --output_dir=runs/photo_shards --split=train --num_shards=16
	$(PY) -m tfscale.benchmark --config=configs/r50_1gpu.py --workdir=runs/bench_input \
	  --config.benchmark.mode=input --config.data.dataset=tfrecord --config.data.data_dir=runs/photo_shards \
	  --config.benchmark.image_dir=runs/photos --config.data.global_batch_size=64 \
	  --config.benchmark.num_batches=80 --config.benchmark.num_warmup_batches=10 --config.benchmark.rounds=5

# tfscale's training step vs Keras model.fit as its users compile it (and matched to tfscale's jit_compile when that
# differs), same model (CIFAR ResNet-20), data and batch, one process.
bench-fit: venv
	$(PY) -m tfscale.benchmark --config=configs/cifar_resnet20.py --workdir=runs/bench_fit \
	  --config.benchmark.mode=train --config.benchmark.compare_keras_fit=True --config.data.dataset=synthetic_learnable \
	  --config.benchmark.num_batches=40 --config.benchmark.num_warmup_batches=5 --config.benchmark.rounds=5

# Time to accuracy on Fashion-MNIST: configs/fmnist_resnet.py vs a plain Keras fit script (tools/keras_fmnist.py), each
# from process start to the test top-1 both reach, rounds interleaved (~10 minutes a round on 2 CPU cores).
bench-tta: venv fashion-mnist
	$(PY) tools/bench_time_to_accuracy.py --workdir=runs/tta --rounds=3

# 1 vs 10 training steps per host sync (train.steps_per_loop), CIFAR ResNet-8 at batch 32, one process.
bench-loop: venv
	$(PY) tools/bench_loop.py --model=cifar_resnet8 --batch=32 --steps=200 --rounds=3 --output=runs/bench_loop.json

# Conversion tool with every core vs one process, on the same real-photo JPEG tree.
bench-convert: venv
	test -d runs/photos || $(PY) tools/make_photo_tree.py runs/photos --classes 10 --per_class 200
	$(PY) tools/bench_convert.py --input_dir=runs/photos --num_shards=16 --rounds=3 --output=runs/bench_convert.json

# Benchmark at 1 vs 2 local workers (1 thread each), MWMS and Horovod interleaved in one run: weak-scaling
# table + plot in runs/sweep/report.{md,png}.
bench-scaling: venv horovod
	$(PY) tools/sweep.py --workdir=runs/sweep --workers=1,2 --backends=mwms,horovod

# Two hosts of a test bed (network namespaces, root only), their link shaped to each rate: the overlap of buckets
# vs one message, measured beside tfscale-plan's prediction from the bed's own microbenchmarks (docs/scaling.md).
bench-netbed: venv
	$(PY) tools/netbed_sweep.py --workdir=runs/netbed --rates_mbit=50,200,1000,0 --rounds=3

# Fault-injection soak (docs/reliability.md): kill -9 / SIGTERM at random steps of a 2-worker run, each
# followed by a resume; the finished run must equal an uninterrupted one. `make soak CYCLES=50`.
CYCLES ?= 20
soak: venv
	$(PY) tools/soak.py --workdir=runs/soak --cycles=$(CYCLES)

clean:
	rm -rf $(VENV) runs .pytest_cache
