#!/usr/bin/env bash
# Builds horovod==0.28.1 from the PyPI sdist against the TensorFlow already installed in PYTHON's
# environment, then checks the build with `horovodrun --check-build`.
#
#   PYTHON=.venv/bin/python tools/install_horovod.sh        (what `make horovod` runs)
#
# Why a script: 0.28.1 is Horovod's last release and does not compile against TF >= 2.19: its XLA
# op file includes XLA headers the TF wheel no longer ships. The XLA ops are GPU-only code, so the
# fix is to compile that block only for GPU builds (one line, below).
#
# Frameworks and collectives follow Horovod's own variables; anything you export passes through:
#   CPU-only host (default here): Gloo for CPU tensors.
#   Cluster: HOROVOD_GPU_OPERATIONS=NCCL (and HOROVOD_NCCL_HOME if NCCL is not in CUDA's tree);
#            MPI is used when `mpicc` is on PATH (HOROVOD_WITH_MPI=1), Gloo stays available.
#   MPI + Gloo (e.g. Debian's openmpi-bin libopenmpi-dev): the launcher picks at run time. mpirun and
#            srun --mpi=pmix ranks use MPI; horovodrun --gloo and tfscale.launch set
#            HOROVOD_CONTROLLER=gloo HOROVOD_CPU_OPERATIONS=gloo. (0.28.1's build-time
#            HOROVOD_CPU_OPERATIONS default never takes effect: CMake defines it unquoted, so the C++
#            `#if ... == 'G'` is false. Do not export HOROVOD_CPU_OPERATIONS=gloo to mpirun ranks:
#            Gloo operations under the MPI controller crash, signal 11.)
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
HOROVOD_VERSION=0.28.1
CONSTRAINTS=${CONSTRAINTS:-$(dirname "$0")/../requirements/constraints-cpu.txt}

tf_version=$("$PYTHON" -c 'import tensorflow as tf; print(tf.__version__)')
echo "install_horovod: building horovod==$HOROVOD_VERSION against TensorFlow $tf_version ($PYTHON)"

# A fresh source tree every time: a build/ left from another TF version links stale absl symbols.
src_root=$(mktemp -d)
trap 'rm -rf "$src_root"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$src_root"
tar -xzf "$src_root/horovod-$HOROVOD_VERSION.tar.gz" -C "$src_root"
src="$src_root/horovod-$HOROVOD_VERSION"

if "$PYTHON" -c "import sys, tensorflow as tf; sys.exit(tuple(map(int, tf.__version__.split('.')[:2])) < (2, 19))"; then
  xla_ops="$src/horovod/tensorflow/xla_mpi_ops.cc"
  guard='#if TENSORFLOW_VERSION >= 2006000000'
  if [ "$(grep -c "^$guard\$" "$xla_ops")" != 1 ]; then
    echo "install_horovod: expected one '$guard' line in $xla_ops; the source changed, fix this script" >&2
    exit 1
  fi
  sed -i "s/^$guard\$/$guard \&\& HAVE_GPU/" "$xla_ops"
  echo "install_horovod: TF >= 2.19: XLA ops compiled for GPU builds only ($xla_ops)"
fi

export HOROVOD_WITH_TENSORFLOW=${HOROVOD_WITH_TENSORFLOW:-1}
export HOROVOD_WITHOUT_PYTORCH=${HOROVOD_WITHOUT_PYTORCH:-1}
export HOROVOD_WITHOUT_MXNET=${HOROVOD_WITHOUT_MXNET:-1}
export HOROVOD_WITH_GLOO=${HOROVOD_WITH_GLOO:-1}
if [ -z "${HOROVOD_GPU_OPERATIONS:-}" ]; then
  export HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-GLOO}
fi
if command -v mpicc > /dev/null && [ -z "${HOROVOD_WITHOUT_MPI:-}" ]; then
  export HOROVOD_WITH_MPI=${HOROVOD_WITH_MPI:-1}
fi
env | grep '^HOROVOD_' | sort | sed 's/^/install_horovod:   /'

# --no-build-isolation: the extension must compile against the TensorFlow installed here.
MAKEFLAGS="-j$(nproc)" "$PYTHON" -m pip install --quiet --no-build-isolation --no-cache-dir \
  -c "$CONSTRAINTS" "$src"

"$(dirname "$PYTHON")/horovodrun" --check-build
if [ "${HOROVOD_WITH_MPI:-}" = 1 ] && ! "$PYTHON" -c 'import horovod.tensorflow as hvd, sys; sys.exit(not hvd.mpi_built())' 2> /dev/null; then
  echo "install_horovod: HOROVOD_WITH_MPI=1 but this Horovod has no MPI; see the build output above" >&2
  exit 1
fi
