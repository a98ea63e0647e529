#!/usr/bin/env bash
# Prints the root of a CUDA toolkit to build Horovod's GPU operations with, for the TensorFlow installed in PYTHON's
# environment; assembles one (for clang) from CUDA 12 pip wheels when the host has no CUDA 12 nvcc.
#
#   PYTHON=.venv-gpu/bin/python tools/cuda_build_home.sh DIR     (tools/install_horovod.sh and `make horovod-gpu`)
#
# Stdout is the toolkit root alone; what was chosen and why goes to stderr. In order:
#   1. $HOROVOD_CUDA_HOME, as given (it must have bin/nvcc).
#   2. The toolkit of `nvcc` on PATH (a cluster's `module load cuda`), else of $CUDA_HOME / $CUDA_PATH, when its
#      major version is the one TensorFlow was built with (tf.sysconfig.get_build_info()['cuda_version']).
#   3. DIR/toolkit: a CUDA 12 toolkit for clang (Debian's clang-19: `make clang-cuda`; another one: CUDA_CLANG=...)
#      as the CUDA compiler. NVIDIA ships no CUDA 12 nvcc on PyPI (nvidia-cuda-nvcc-cu12 has ptxas and libdevice
#      only), but clang compiles CUDA itself and needs no more than these, from the CUDA 12 wheels TensorFlow installed
#      (ptxas, libdevice, the runtime and curand headers), plus what requirements/cuda-build-wheels.txt installs into
#      DIR (`pip install --target`, out of the venv's site-packages; reused while that file is unchanged): CCCL's
#      headers and nvFatbin, which tools/cuda_fatbinary.py uses as the `fatbinary` step clang calls. The toolkit has
#      bin/clang++ (the CUDA compiler), no bin/nvcc: that is how tools/install_horovod.sh tells the two kinds apart.
# Only the build needs the toolkit: Horovod's CUDA calls go to TensorFlow's CUDA runtime, or, built with another
# major version than TensorFlow's (a CUDA 13 HOROVOD_CUDA_HOME), to that toolkit's runtime linked in statically.
set -euo pipefail

PYTHON=${PYTHON:-.venv-gpu/bin/python}
CUDA_CLANG=${CUDA_CLANG:-clang++-19}
dest=${1:?usage: PYTHON=... $0 DIR (where to assemble a CUDA 12 toolkit for clang when no nvcc fits)}
tools=$(cd "$(dirname "$0")" && pwd)
requirements=$(cd "$tools/.." && pwd)/requirements/cuda-build-wheels.txt
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

# 3. clang + CUDA 12 wheels.
if [ "${tf_cuda%%.*}" != 12 ]; then
  say "TensorFlow was built with CUDA $tf_cuda; the clang toolkit here is assembled from CUDA 12 wheels only"
  exit 1
fi
clang=$(command -v "$CUDA_CLANG" || true)
if [ -z "$clang" ]; then
  say "no CUDA $tf_cuda nvcc here, and no $CUDA_CLANG to compile CUDA with: \`make clang-cuda\` (Debian's clang-19,"
  say "as root), or CUDA_CLANG=<clang++ >= 19>, or a CUDA 12 toolkit on PATH (module load cuda/12.x)"
  exit 1
fi
# The CUDA 12 wheels of tensorflow[and-cuda], where that venv has them (import paths, not pip metadata).
wheel_dir() {
  "$PYTHON" -c "import sys, $1 as m; sys.stdout.write(list(m.__path__)[0])" 2> /dev/null \
    || { say "no $1 in $PYTHON's environment (a tensorflow[and-cuda] venv has it)"; exit 1; }
}
nvcc_wheel=$(wheel_dir nvidia.cuda_nvcc)
runtime_wheel=$(wheel_dir nvidia.cuda_runtime)
curand_wheel=$(wheel_dir nvidia.curand)  # clang's CUDA wrapper headers include curand_mtgp32_kernel.h
runtime_version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("nvidia-cuda-runtime-cu12"))')
for f in "$nvcc_wheel/bin/ptxas" "$nvcc_wheel/nvvm/libdevice/libdevice.10.bc" "$runtime_wheel/include/cuda_runtime.h" \
    "$runtime_wheel/lib/libcudart.so.12" "$curand_wheel/include/curand_mtgp32_kernel.h"; do
  [ -e "$f" ] || { say "no $f: the CUDA 12 wheels changed their layout"; exit 1; }
done

mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
wheels="$dest/wheels"
if [ "$(cat "$wheels/.installed" 2> /dev/null)" != "$(cat "$requirements")" ]; then
  say "installing $(grep -c '^nvidia' "$requirements") CUDA 12 build wheels into $wheels"
  rm -rf "$wheels"
  "$PYTHON" -m pip install --quiet --no-deps --target "$wheels" -r "$requirements"
  cp "$requirements" "$wheels/.installed"
fi
cccl_include="$wheels/nvidia/cuda_cccl/include"
nvfatbin="$wheels/nvidia/nvfatbin/lib/libnvfatbin.so.12"
[ -e "$cccl_include/nv/target" ] && [ -e "$nvfatbin" ] || { say "no CCCL or nvFatbin under $wheels: $requirements changed"; exit 1; }

# The toolkit: symlinks into those wheels, laid out as clang (--cuda-path) and CMake's FindCUDAToolkit look for it.
# Rebuilt every time (cheap): the venv's wheels may have been upgraded since.
home="$dest/toolkit"
rm -rf "$home"
mkdir -p "$home/bin" "$home/include" "$home/lib64" "$home/nvvm"
ln -s "$clang" "$home/bin/clang++"
ln -s "$nvcc_wheel/bin/ptxas" "$home/bin/ptxas"
printf '#!/bin/sh\n# fatbinary for clang: tools/cuda_fatbinary.py over CUDA 12 nvFatbin\nexec "%s" "%s" "%s" "$@"\n' \
  "$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" "$tools/cuda_fatbinary.py" "$nvfatbin" > "$home/bin/fatbinary"
chmod +x "$home/bin/fatbinary"
ln -s "$nvcc_wheel/nvvm/libdevice" "$home/nvvm/libdevice"
for dir in "$runtime_wheel/include" "$nvcc_wheel/include" "$curand_wheel/include" "$cccl_include"; do
  for entry in "$dir"/*; do
    case $(basename "$entry") in __init__.py | __pycache__) continue ;; esac
    [ -e "$home/include/$(basename "$entry")" ] || ln -s "$entry" "$home/include/"
  done
done
# FindCUDAToolkit (Horovod's find_package(CUDAToolkit REQUIRED)) wants lib64/libcudart.so, and, with no nvcc, a
# version.txt. Nothing links that libcudart: Horovod's CUDA calls bind to TensorFlow's runtime.
ln -s "$runtime_wheel/lib/libcudart.so.12" "$home/lib64/libcudart.so"
echo "CUDA Version $runtime_version" > "$home/version.txt"

clang_version=$("$clang" --version | head -1)
say "using $clang ($clang_version) with the CUDA 12 wheels (runtime $runtime_version, ptxas $("$home/bin/ptxas" --version | sed -n 's/.*release .*, V\([0-9.]*\)$/\1/p')) at $home"
echo "$home"
