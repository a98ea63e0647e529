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
#            `make horovod-gpu` does this in a tensorflow[and-cuda] venv (.venv-gpu):
#              PYTHON=.venv-gpu/bin/python HOROVOD_GPU_OPERATIONS=NCCL tools/install_horovod.sh
#            CUDA toolkit: HOROVOD_CUDA_HOME, else what tools/cuda_build_home.sh finds or assembles (a CUDA 12
#            `module load cuda`, else pip wheels into CUDA_BUILD_DIR, default <venv>/cuda-build). NCCL: HOROVOD_NCCL_*,
#            else the nvidia-nccl-cu12 wheel TensorFlow itself loads. CUDA archs: HOROVOD_BUILD_CUDA_CC_LIST, else
#            TensorFlow's own list (tf.sysconfig.get_build_info()) as far as that nvcc can build it. A toolkit of
#            another CUDA major version than TensorFlow's (the CUDA 13 wheels) brings its own static runtime.
#            TF >= 2.19 GPU builds get three more source patches (below), each checked against the installed headers.
#   MPI + Gloo (e.g. Debian's openmpi-bin libopenmpi-dev): the launcher picks at run time. mpirun and
#            srun --mpi=pmix ranks use MPI; horovodrun --gloo and tfscale.launch set
#            HOROVOD_CONTROLLER=gloo HOROVOD_CPU_OPERATIONS=gloo. (0.28.1's build-time
#            HOROVOD_CPU_OPERATIONS default never takes effect: CMake defines it unquoted, so the C++
#            `#if ... == 'G'` is false. Do not export HOROVOD_CPU_OPERATIONS=gloo to mpirun ranks:
#            Gloo operations under the MPI controller crash, signal 11.)
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
HOROVOD_VERSION=0.28.1
if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ]; then
  CONSTRAINTS=${CONSTRAINTS:-$(dirname "$0")/../requirements/constraints-gpu.txt}
else
  CONSTRAINTS=${CONSTRAINTS:-$(dirname "$0")/../requirements/constraints-cpu.txt}
fi

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

# GPU builds (HAVE_GPU): mpi_ops.cc's GPU paths and xla_mpi_ops.cc compile. Against TF >= 2.19 they need three
# source patches, and the XLA headers need two include directories the TF wheel ships but does not put on its
# include path (tf.sysconfig.get_compile_flags()). Each patch first checks the text it replaces, and the installed
# TF header that makes the replacement right.
if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ] \
    && "$PYTHON" -c "import sys, tensorflow as tf; sys.exit(tuple(map(int, tf.__version__.split('.')[:2])) < (2, 19))"; then
  tf_include=$("$PYTHON" -c 'import tensorflow as tf; print(tf.sysconfig.get_include())')
  xla_ops="$src/horovod/tensorflow/xla_mpi_ops.cc"
  gpu_fail() { echo "install_horovod: $*; the source or TensorFlow's headers changed, fix this script" >&2; exit 1; }
  # replace_exact FILE COUNT OLD NEW: OLD must occur exactly COUNT times in FILE.
  replace_exact() {
    "$PYTHON" - "$@" <<'PY' || exit 1
import sys
path, count, old, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
text = open(path).read()
if text.count(old) != count:
    sys.exit(f"install_horovod: expected {count} of {old!r} in {path}, found {text.count(old)}; "
             "the source changed, fix this script")
open(path, "w").write(text.replace(old, new))
PY
  }
  need_header() {  # need_header PATH [TEXT]: PATH under TF's include dir exists (and contains TEXT)
    [ -f "$tf_include/$1" ] || gpu_fail "TensorFlow $tf_version has no $tf_include/$1"
    [ -z "${2:-}" ] || grep -qF "$2" "$tf_include/$1" || gpu_fail "$tf_include/$1 no longer has '$2'"
  }

  # (1) XlaBuilder moved from xla/client/ to xla/hlo/builder/.
  need_header tensorflow/compiler/xla/hlo/builder/xla_builder.h 'class XlaBuilder {'
  replace_exact "$xla_ops" 1 '#include "tensorflow/compiler/xla/client/xla_builder.h"' \
    '#include "tensorflow/compiler/xla/hlo/builder/xla_builder.h"'
  # (2) xla::StatusOr is gone; XlaBuilder's API (GetShape, ReportErrorOrReturn) uses absl::StatusOr.
  need_header xla/hlo/builder/xla_builder.h 'XlaOp ReportErrorOrReturn(const absl::StatusOr<XlaOp>& op);'
  replace_exact "$xla_ops" 2 '::xla::StatusOr<::xla::XlaOp>' 'absl::StatusOr<::xla::XlaOp>'
  # (3) stream_executor::gpu::AsGpuStreamValue is gone: mpi_ops.cc only forward-declares it, and no TF library
  # exports it any more, so the extension would link and then fail to load (undefined symbol). Define it from
  # Stream::platform_specific_handle(), whose .stream is the CUstream (= cudaStream_t); the twelve call sites stay.
  need_header xla/stream_executor/stream.h 'virtual PlatformSpecificHandle platform_specific_handle() const = 0;'
  need_header xla/stream_executor/cuda/cuda_stream.h 'return {stream_handle_};'
  replace_exact "$src/horovod/tensorflow/mpi_ops.cc" 1 '// Forward declaration of AsGpuStreamValue
namespace stream_executor {
namespace gpu {
GpuStreamHandle AsGpuStreamValue(Stream* stream);
} // namespace stream_executor
} // namespace gpu
#if TENSORFLOW_VERSION >= 2011000000
#include "tensorflow/compiler/xla/stream_executor/stream.h"
#else
#include "tensorflow/stream_executor/stream.h"
#endif // TENSORFLOW_VERSION >= 2011000000
' '#if TENSORFLOW_VERSION >= 2011000000
#include "tensorflow/compiler/xla/stream_executor/stream.h"
#else
#include "tensorflow/stream_executor/stream.h"
#endif // TENSORFLOW_VERSION >= 2011000000
// TF >= 2.19 has no stream_executor::gpu::AsGpuStreamValue; the Stream hands out its CUstream itself.
namespace stream_executor {
namespace gpu {
inline GpuStreamHandle AsGpuStreamValue(Stream* stream) {
  return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream);
}
} // namespace gpu
} // namespace stream_executor
'
  # XLA headers include "highwayhash/..." (xla/printer.h) and "farmhash.h" (tsl/platform/fingerprint.h).
  for dir in external/highwayhash external/farmhash_archive/src; do
    [ -d "$tf_include/$dir" ] || gpu_fail "TensorFlow $tf_version has no $tf_include/$dir"
    export CXXFLAGS="${CXXFLAGS:+$CXXFLAGS }-isystem $tf_include/$dir"
  done
  echo "install_horovod: TF >= 2.19 GPU build: XlaBuilder header, absl::StatusOr and AsGpuStreamValue patched"
fi

if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ]; then
  if [ -z "${HOROVOD_CUDA_HOME:-}" ]; then
    if [ -z "${CUDA_BUILD_DIR:-}" ]; then  # where pip wheels go if they are needed: beside the venv's site-packages
      venv=$("$PYTHON" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")')
      CUDA_BUILD_DIR=${venv:-${XDG_CACHE_HOME:-$HOME/.cache}/tfscale}/cuda-build
    fi
    HOROVOD_CUDA_HOME=$(PYTHON="$PYTHON" "$(dirname "$0")/cuda_build_home.sh" "$CUDA_BUILD_DIR")
  fi
  HOROVOD_CUDA_HOME=$(cd "$HOROVOD_CUDA_HOME" && pwd)  # absolute: CMake runs in a build directory of its own
  export HOROVOD_CUDA_HOME
  export PATH="$HOROVOD_CUDA_HOME/bin:$PATH"  # Horovod lists the CUDA archs with the first `nvcc` on PATH
  # The archs TensorFlow is built for, as far as this nvcc builds them: an arch it dropped is replaced by its
  # lowest one of the same major version (sm_70 -> sm_75), else left out (said so).
  if [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then
    HOROVOD_BUILD_CUDA_CC_LIST=$("$PYTHON" - "$HOROVOD_CUDA_HOME/bin/nvcc" <<'PY'
import re, subprocess, sys
import tensorflow as tf
wanted = sorted({int(re.sub(r"\D", "", c)) for c in tf.sysconfig.get_build_info().get("cuda_compute_capabilities", [])})
have = sorted({int(m) for m in re.findall(r"sm_(\d+)\b", subprocess.check_output([sys.argv[1], "--list-gpu-code"], text=True))})
chosen = set()
for cc in wanted:
    same_major = [h for h in have if h // 10 == cc // 10 and h >= cc]
    if same_major:
        chosen.add(same_major[0])
    else:
        print(f"install_horovod: this nvcc cannot build sm_{cc} (TensorFlow has it): no Horovod kernels for those GPUs",
              file=sys.stderr)
print(",".join(map(str, sorted(chosen))))
PY
    )
    [ -n "$HOROVOD_BUILD_CUDA_CC_LIST" ] || { echo "install_horovod: no CUDA arch to build for" >&2; exit 1; }
    export HOROVOD_BUILD_CUDA_CC_LIST
  fi
  # TensorFlow's libtensorflow_framework.so.2 exports the whole CUDA runtime API (a stub that loads its own
  # libcudart.so.12), and Horovod's link line names it before the static CUDA runtime Horovod means to link
  # (CMAKE_CUDA_RUNTIME_LIBRARY Static), so every CUDA call, kernel registration and launch included, binds to
  # TensorFlow's runtime. Fine with a toolkit of TF's major version (12); with another (the CUDA 13 wheels) the
  # kernels nvcc compiled must go through the runtime of their own toolkit: link it in whole, first. (The version
  # script horovod.lds keeps its symbols local to Horovod's library.)
  tf_cuda=$("$PYTHON" -c 'import tensorflow as tf; print(tf.sysconfig.get_build_info()["cuda_version"])')
  nvcc_release=$("$HOROVOD_CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
  HOROVOD_CUDA_RUNTIME=$tf_cuda  # the runtime Horovod's CUDA calls reach: TensorFlow's, unless linked in below
  if [ "${nvcc_release%%.*}" != "${tf_cuda%%.*}" ]; then
    HOROVOD_CUDA_RUNTIME=$nvcc_release
    cudart_static="$HOROVOD_CUDA_HOME/lib64/libcudart_static.a"
    [ -f "$cudart_static" ] || { echo "install_horovod: no $cudart_static" >&2; exit 1; }
    export LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,--whole-archive $cudart_static -Wl,--no-whole-archive -ldl -lrt -lpthread"
    echo "install_horovod: CUDA $nvcc_release toolkit, TensorFlow built with CUDA $tf_cuda: Horovod gets its own static CUDA $nvcc_release runtime (needs a driver for CUDA $nvcc_release)"
  fi
  # NCCL: the nvidia-nccl-cu12 wheel that TensorFlow loads (its RUNPATH points there), unless told otherwise, so that
  # one libnccl.so.2 serves both. The wheel has no unversioned libnccl.so for the linker: one is linked in for the
  # build and removed after it (the extension's RUNPATH keeps the wheel's lib directory).
  if [ "$HOROVOD_GPU_OPERATIONS" = NCCL ] && [ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}${HOROVOD_NCCL_LIB:-}" ]; then
    nccl_wheel=$("$PYTHON" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2> /dev/null || true)
    if [ -n "$nccl_wheel" ] && [ -f "$nccl_wheel/include/nccl.h" ] && [ -f "$nccl_wheel/lib/libnccl.so.2" ]; then
      export HOROVOD_NCCL_INCLUDE="$nccl_wheel/include" HOROVOD_NCCL_LIB="$nccl_wheel/lib" HOROVOD_NCCL_LINK=SHARED
      if [ ! -e "$nccl_wheel/lib/libnccl.so" ]; then
        ln -s libnccl.so.2 "$nccl_wheel/lib/libnccl.so"
        trap 'rm -rf "$src_root"; rm -f "$nccl_wheel/lib/libnccl.so"' EXIT
      fi
    fi
  fi
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
if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ]; then
  env | grep '^CXXFLAGS=\|^LDFLAGS=' | sed 's/^/install_horovod:   /' || true
fi

# --no-build-isolation: the extension must compile against the TensorFlow installed here.
MAKEFLAGS="-j$(nproc)" "$PYTHON" -m pip install --quiet --no-build-isolation --no-cache-dir \
  -c "$CONSTRAINTS" "$src"

"$(dirname "$PYTHON")/horovodrun" --check-build
if [ "${HOROVOD_WITH_MPI:-}" = 1 ] && ! "$PYTHON" -c 'import horovod.tensorflow as hvd, sys; sys.exit(not hvd.mpi_built())' 2> /dev/null; then
  echo "install_horovod: HOROVOD_WITH_MPI=1 but this Horovod has no MPI; see the build output above" >&2
  exit 1
fi
# A GPU build must import (no GPU or driver needed) and have NCCL; TensorFlow's import chatter only on failure.
if [ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ]; then
  out=$("$PYTHON" -c "import horovod, horovod.tensorflow as hvd
assert hvd.nccl_built(), 'HOROVOD_GPU_OPERATIONS=NCCL but hvd.nccl_built() is false'
print('install_horovod: horovod', horovod.__version__, 'nccl_built', hvd.nccl_built(), 'mpi_built', hvd.mpi_built(),
      'gloo_built', hvd.gloo_built(), 'cuda_built', hvd.cuda_built())" 2>&1) || { echo "$out" >&2; exit 1; }
  echo "$out" | grep '^install_horovod: horovod '
fi
# GPU builds: the CUDA runtime Horovod calls and the oldest driver that runs it, printed and recorded beside
# Horovod's package, where tfscale-doctor's driver check reads it (tfscale/cluster/driver.py).
if [ -n "${HOROVOD_CUDA_RUNTIME:-}" ]; then
  "$PYTHON" - "$HOROVOD_CUDA_RUNTIME" "$HOROVOD_VERSION" <<'PY'
import importlib.util, json, os, sys
from tfscale.cluster import driver
runtime, version = sys.argv[1], sys.argv[2]
package = list(importlib.util.find_spec("horovod").submodule_search_locations)[0]
record = {"horovod": version, "cuda_runtime": runtime, "min_driver_major": driver.min_driver_major(runtime)}
with open(os.path.join(package, driver.BUILD_RECORD), "w") as f:
    json.dump(record, f)
print(f"install_horovod: Horovod's CUDA calls go to a CUDA {runtime} runtime: NVIDIA driver >= "
      f"{record['min_driver_major']} needed (recorded in {os.path.join(package, driver.BUILD_RECORD)})")
PY
fi
