#!/usr/bin/env bash
# Prints the root of a CUDA toolkit (bin/nvcc, include/, lib64/) to build Horovod's GPU operations with, for the
# TensorFlow installed in PYTHON's environment; assembles one from pip wheels when the host has none that fits.
#
#   PYTHON=.venv-gpu/bin/python tools/cuda_build_home.sh DIR     (tools/install_horovod.sh and `make horovod-gpu`)
#
# Stdout is the toolkit root alone (for HOROVOD_CUDA_HOME); what was chosen and why goes to stderr. In order:
#   1. $HOROVOD_CUDA_HOME, as given.
#   2. The toolkit of `nvcc` on PATH (a cluster's `module load cuda`), else of $CUDA_HOME / $CUDA_PATH, when its
#      major version is the one TensorFlow was built with (tf.sysconfig.get_build_info()['cuda_version']).
#   3. The wheels pinned in requirements/cuda-build-wheels.txt, installed into DIR with `pip install --target`
#      (kept out of the venv's site-packages; reused while that file is unchanged). They are CUDA 13.0: no pip
#      wheel has a CUDA 12 nvcc. That file says what this costs (driver >= 580, no pre-Turing kernels).
# Only the build needs the toolkit: Horovod's CUDA calls go to TensorFlow's CUDA runtime, or, built with another
# major version than TensorFlow's (the CUDA 13 wheels), to that toolkit's runtime linked in statically.
set -euo pipefail

PYTHON=${PYTHON:-.venv-gpu/bin/python}
dest=${1:?usage: PYTHON=... $0 DIR (where to install the CUDA build wheels when no toolkit fits)}
requirements=$(cd "$(dirname "$0")/.." && pwd)/requirements/cuda-build-wheels.txt
say() { echo "cuda_build_home: $*" >&2; }

# Absolute paths only: Horovod's CMake runs in a build directory of its own.
if [ -n "${HOROVOD_CUDA_HOME:-}" ]; then
  [ -x "$HOROVOD_CUDA_HOME/bin/nvcc" ] || { say "HOROVOD_CUDA_HOME=$HOROVOD_CUDA_HOME has no bin/nvcc"; exit 1; }
  say "using HOROVOD_CUDA_HOME=$HOROVOD_CUDA_HOME as given"
  (cd "$HOROVOD_CUDA_HOME" && pwd)
  exit 0
fi

tf_cuda=$("$PYTHON" -c 'import tensorflow as tf; print(tf.sysconfig.get_build_info().get("cuda_version", ""))' 2> /dev/null)
[ -n "$tf_cuda" ] || { say "the TensorFlow of $PYTHON is not a CUDA build (install tensorflow[and-cuda])"; exit 1; }

# nvcc --version ends with e.g. "Cuda compilation tools, release 12.4, V12.4.131".
nvcc_release() { "$1" --version 2> /dev/null | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p'; }

candidates=()
if command -v nvcc > /dev/null; then  # its toolkit root, through wrapper scripts and symlinks (nvcc says where it runs)
  here=$(nvcc --dryrun -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
  [ -n "$here" ] && candidates+=("$(dirname "$here")")
fi
for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do [ -n "$root" ] && candidates+=("$root"); done
for root in ${candidates[@]+"${candidates[@]}"}; do
  release=$(nvcc_release "$root/bin/nvcc")
  if [ -n "$release" ] && [ "${release%%.*}" = "${tf_cuda%%.*}" ]; then
    say "using the CUDA $release toolkit at $root (TensorFlow was built with CUDA $tf_cuda)"
    echo "$root"
    exit 0
  fi
  [ -n "$release" ] && say "not using the CUDA $release toolkit at $root: TensorFlow was built with CUDA $tf_cuda"
done

# 3. pip wheels. Their tree, nvidia/cu13/{bin,include,lib,nvvm}, is a toolkit already, except for what CMake's
# FindCUDAToolkit and nvcc.profile look for: an unversioned libcudart.so (CUDA_CUDART) and lib64/.
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
stamp="$dest/.installed"
if [ "$(cat "$stamp" 2> /dev/null)" != "$(cat "$requirements")" ]; then
  say "no CUDA ${tf_cuda%%.*} toolkit here; installing $(grep -c '^nvidia' "$requirements") CUDA wheels into $dest"
  rm -rf "$dest"
  "$PYTHON" -m pip install --quiet --no-deps --target "$dest" -r "$requirements"
  cp "$requirements" "$stamp"
fi
homes=("$dest"/nvidia/cu[0-9]*)
home=${homes[0]}
[ -x "$home/bin/nvcc" ] || { say "no bin/nvcc under $dest/nvidia: $requirements changed its layout"; exit 1; }
[ -e "$home/lib64" ] || ln -s lib "$home/lib64"
cudarts=("$home"/lib/libcudart.so.[0-9]*)
[ -e "$home/lib/libcudart.so" ] || ln -s "$(basename "${cudarts[0]}")" "$home/lib/libcudart.so"
say "using the CUDA $(nvcc_release "$home/bin/nvcc") wheels at $home (TensorFlow was built with CUDA $tf_cuda)"
echo "$home"
