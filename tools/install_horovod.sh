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
#            `module load cuda`, else a CUDA 12 toolkit of pip wheels in CUDA_BUILD_DIR, default <venv>/cuda-build,
#            with clang as its CUDA compiler: three more CMake patches, below). NCCL: HOROVOD_NCCL_*, else the
#            nvidia-nccl-cu12 wheel TensorFlow itself loads. CUDA archs: HOROVOD_BUILD_CUDA_CC_LIST, else
#            TensorFlow's own list (tf.sysconfig.get_build_info()) as far as that compiler can build it. Horovod's CUDA
#            calls go to TensorFlow's CUDA 12 runtime; a toolkit of another major version (HOROVOD_CUDA_HOME of a
#            CUDA 13) brings its own static runtime.
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
  cuda_home=${HOROVOD_CUDA_HOME:-}
  if [ -z "$cuda_home" ]; then
    if [ -z "${CUDA_BUILD_DIR:-}" ]; then  # where pip wheels go if they are needed: beside the venv's site-packages
      venv=$("$PYTHON" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")')
      CUDA_BUILD_DIR=${venv:-${XDG_CACHE_HOME:-$HOME/.cache}/tfscale}/cuda-build
    fi
    cuda_home=$(PYTHON="$PYTHON" "$(dirname "$0")/cuda_build_home.sh" "$CUDA_BUILD_DIR")
  fi
  cuda_home=$(cd "$cuda_home" && pwd)  # absolute: CMake runs in a build directory of its own
  tf_cuda=$("$PYTHON" -c 'import tensorflow as tf; print(tf.sysconfig.get_build_info()["cuda_version"])')
  tf_cudart=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("nvidia-cuda-runtime-cu12"))' 2> /dev/null \
    || echo "of the host")
fi

if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ] && [ -x "$cuda_home/bin/nvcc" ]; then
  # nvcc: Horovod's own build (CMake's CUDA language).
  export HOROVOD_CUDA_HOME=$cuda_home
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
  # TensorFlow's runtime. Fine with a toolkit of TF's major version (12); with another (a CUDA 13 HOROVOD_CUDA_HOME)
  # the kernels nvcc compiled must go through the runtime of their own toolkit: link it in whole, first. (The
  # version script horovod.lds keeps its symbols local to Horovod's library.)
  nvcc_release=$("$HOROVOD_CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
  HOROVOD_CUDA_RUNTIME=$tf_cuda  # the runtime Horovod's CUDA calls reach: TensorFlow's, unless linked in below
  if [ "${nvcc_release%%.*}" != "${tf_cuda%%.*}" ]; then
    HOROVOD_CUDA_RUNTIME=$nvcc_release
    cudart_static="$HOROVOD_CUDA_HOME/lib64/libcudart_static.a"
    [ -f "$cudart_static" ] || { echo "install_horovod: no $cudart_static" >&2; exit 1; }
    export LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,--whole-archive $cudart_static -Wl,--no-whole-archive -ldl -lrt -lpthread"
    echo "install_horovod: CUDA $nvcc_release toolkit, TensorFlow built with CUDA $tf_cuda: Horovod gets its own static CUDA $nvcc_release runtime (needs a driver for CUDA $nvcc_release)"
  else
    echo "install_horovod: CUDA $nvcc_release nvcc; Horovod's CUDA calls go to TensorFlow's CUDA runtime (libcudart.so.12 $tf_cudart)"
  fi
elif [ -n "${HOROVOD_GPU_OPERATIONS:-}" ]; then
  # clang (tools/cuda_build_home.sh's CUDA 12 toolkit: bin/clang++, no nvcc). CMake's CUDA language cannot take clang
  # without an nvcc to find the toolkit by, so it stays off: cuda_kernels.cu becomes one clang command (host and
  # device code, cubins from the CUDA 12 ptxas) in Horovod's CMake, whose CUDA parts are patched for that below.
  # No CUDA runtime is linked: Horovod's CUDA calls, kernel registration and launches included, bind to
  # libtensorflow_framework.so.2, TensorFlow's stub over its libcudart.so.12, as in a CUDA 12 nvcc build.
  clang="$cuda_home/bin/clang++"
  [ -x "$clang" ] || { echo "install_horovod: $cuda_home has neither bin/nvcc nor bin/clang++" >&2; exit 1; }
  # TensorFlow's archs (or HOROVOD_BUILD_CUDA_CC_LIST) that this clang targets: a cubin each, and PTX for the newest
  # (JIT-compiled by the driver on newer GPUs). The PTX ISA version is pinned to the first one that has the newest
  # arch (7.8 for sm_90, from CUDA 11.8), not clang's default (that of the CUDA it finds, capped at what it knows),
  # so that any CUDA 12 driver can JIT it.
  clang_cuda=$("$PYTHON" - "$clang" "$cuda_home" "${HOROVOD_BUILD_CUDA_CC_LIST:-}" <<'PY'
import re, subprocess, sys
import tensorflow as tf
clang, home, cc_list = sys.argv[1:4]
caps = cc_list.split(",") if cc_list else tf.sysconfig.get_build_info().get("cuda_compute_capabilities", [])
wanted = sorted({int(re.sub(r"\D", "", c)) for c in caps if c.strip()})
# The PTX ISA version that introduced each arch (PTX ISA release notes).
FIRST_PTX = {60: (5, 0), 61: (5, 0), 62: (5, 0), 70: (6, 0), 72: (6, 1), 75: (6, 3), 80: (7, 0), 86: (7, 1),
             87: (7, 4), 89: (7, 8), 90: (7, 8)}
chosen = []
for cc in wanted:
    probe = subprocess.run([clang, "-x", "cuda", f"--cuda-path={home}", "-Wno-unknown-cuda-version",
                            f"--cuda-gpu-arch=sm_{cc}", "--cuda-device-only", "-S", "-o", "/dev/null", "-"],
                           input="", capture_output=True, text=True)
    if probe.returncode == 0:
        chosen.append(cc)
    else:
        print(f"install_horovod: {clang} cannot build sm_{cc} (TensorFlow has it): no Horovod kernels for those GPUs\n"
              f"{probe.stderr.strip()}", file=sys.stderr)
if not chosen:
    sys.exit("install_horovod: no CUDA arch to build for")
flags = [f"--cuda-gpu-arch=sm_{cc}" for cc in chosen]
flags += ["--no-cuda-include-ptx=all", f"--cuda-include-ptx=sm_{chosen[-1]}"]
# An arch newer than this table: clang's default PTX version, said so.
ptx = max(FIRST_PTX[cc] for cc in chosen) if all(cc in FIRST_PTX for cc in chosen) else None
if ptx:
    flags.append(f"--cuda-feature=+ptx{ptx[0]}{ptx[1]}")
print(" ".join(flags))
print("sm_" + ",sm_".join(map(str, chosen)), f"compute_{chosen[-1]}", f"{ptx[0]}.{ptx[1]}" if ptx else "clang's default")
PY
  ) || exit 1
  read -r arch_flags <<< "$(echo "$clang_cuda" | sed -n 1p)"
  read -r cubins ptx_arch ptx_isa <<< "$(echo "$clang_cuda" | sed -n 2p)"
  # Clang 19 knows CUDA up to 12.5 and warns for newer headers (12.9 here), using them as 12.5's (-Wunknown-cuda-version).
  export TFSCALE_CLANG_CUDA="$clang" TFSCALE_CLANG_CUDA_HOME="$cuda_home"
  export TFSCALE_CLANG_CUDA_FLAGS="-O3 -fPIC -std=c++17 -Wno-unknown-cuda-version $arch_flags"
  HOROVOD_CUDA_RUNTIME=$tf_cuda  # no runtime linked: TensorFlow's

  # (a) Top-level CMakeLists.txt: in clang mode no CUDA language (its check would find any nvcc on PATH, e.g. a CUDA 13
  # one, and enable_language(CUDA) with clang needs an nvcc); find_package(CUDAToolkit) is pointed at the toolkit.
  replace_exact "$src/CMakeLists.txt" 1 'if(DEFINED ENV{HOROVOD_CUDA_HOME})
    set(CMAKE_CUDA_COMPILER "$ENV{HOROVOD_CUDA_HOME}/bin/nvcc")
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
' '# tfscale (tools/install_horovod.sh): clang compiles the CUDA kernels (horovod/common/ops/cuda/CMakeLists.txt);
# no CUDA language, whose Clang support needs an nvcc.
if(DEFINED ENV{TFSCALE_CLANG_CUDA})
    set(CUDAToolkit_ROOT "$ENV{TFSCALE_CLANG_CUDA_HOME}")
elseif(DEFINED ENV{HOROVOD_CUDA_HOME})
    set(CMAKE_CUDA_COMPILER "$ENV{HOROVOD_CUDA_HOME}/bin/nvcc")
endif()
include(CheckLanguage)
if(NOT DEFINED ENV{TFSCALE_CLANG_CUDA})
    check_language(CUDA)
endif()
if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{TFSCALE_CLANG_CUDA})
'
  # (b) The CUDA headers for Horovod's C++ files came from the CUDA language only; add FindCUDAToolkit's.
  replace_exact "$src/CMakeLists.txt" 1 'include_directories(SYSTEM ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})' \
    'include_directories(SYSTEM ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES} ${CUDAToolkit_INCLUDE_DIRS})'
  # (c) The kernel libraries: one clang command each instead of nvcc and its flags (build_utils.get_nvcc_flags()).
  replace_exact "$src/horovod/common/ops/cuda/CMakeLists.txt" 1 'set(ENV{PYTHONPATH} "${PROJECT_SOURCE_DIR}/cmake:$ENV{PYTHONPATH}")
' '# tfscale (tools/install_horovod.sh): clang compiles cuda_kernels.cu, host and device code, into an object of each
# library (TFSCALE_CLANG_CUDA_FLAGS: archs, PTX version, optimization); no CUDA language, no nvcc.
if(DEFINED ENV{TFSCALE_CLANG_CUDA})
    separate_arguments(TFSCALE_CLANG_CUDA_FLAGS UNIX_COMMAND "$ENV{TFSCALE_CLANG_CUDA_FLAGS}")
    function(tfscale_clang_cuda_kernels target cxx11_abi)
        set(object "${CMAKE_CURRENT_BINARY_DIR}/${target}.o")
        add_custom_command(OUTPUT "${object}"
            COMMAND "$ENV{TFSCALE_CLANG_CUDA}" -x cuda "--cuda-path=$ENV{TFSCALE_CLANG_CUDA_HOME}"
                    ${TFSCALE_CLANG_CUDA_FLAGS} -D_GLIBCXX_USE_CXX11_ABI=${cxx11_abi}
                    -c "${CMAKE_CURRENT_SOURCE_DIR}/cuda_kernels.cu" -o "${object}"
            DEPENDS cuda_kernels.cu cuda_kernels.h
            COMMENT "clang: CUDA kernels ${target}"
            VERBATIM)
        add_library(${target} STATIC "${object}")
        set_target_properties(${target} PROPERTIES LINKER_LANGUAGE CXX)
    endfunction()
    tfscale_clang_cuda_kernels(horovod_cuda_kernels 1)
    tfscale_clang_cuda_kernels(compatible_horovod_cuda_kernels 0)
    return()
endif()
set(ENV{PYTHONPATH} "${PROJECT_SOURCE_DIR}/cmake:$ENV{PYTHONPATH}")
'
  # The minimum driver: CUDA 12 minor version compatibility (a CUDA 12.x runtime, and ptxas 12.x cubins, on any driver
  # >= 525.60.13), and for the PTX JIT the CUDA release of its ISA version (7.8: CUDA 11.8, driver >= 520).
  case $ptx_isa in
    [1-7].* | 8.0) min_driver="525.60.13 (CUDA 12.0)" ;;
    *) min_driver="525.60.13 (CUDA 12.0) for the cubins; the PTX JIT needs a driver that knows PTX ISA $ptx_isa" ;;
  esac
  echo "install_horovod: CUDA kernels by $("$clang" --version | head -1) with the CUDA 12 wheels at $cuda_home: cubins $cubins (ptxas $("$cuda_home/bin/ptxas" --version | sed -n 's/.*release .*, V\([0-9.]*\)$/\1/p')), PTX ISA $ptx_isa for $ptx_arch"
  echo "install_horovod: CUDA runtime: none linked; TensorFlow's libcudart.so.12 ($tf_cudart) through libtensorflow_framework.so.2. NVIDIA driver needed: >= $min_driver"
fi

if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ]; then
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
env | grep '^HOROVOD_\|^TFSCALE_CLANG_' | sort | sed 's/^/install_horovod:   /'
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
# A clang build: what the built extension binds its CUDA calls to, and what its fatbin holds (from the binary: the
# ELF dynamic section, and the .nv_fatbin section, whose cubins' e_flags name their sm_XX and whose PTX is plain text).
if [ -n "${TFSCALE_CLANG_CUDA:-}" ]; then
  "$PYTHON" - <<'PY' || exit 1
import glob, os, re, struct, subprocess, sys, sysconfig, tempfile
site = sysconfig.get_paths()["platlib"]
lib = glob.glob(os.path.join(site, "horovod", "tensorflow", "mpi_lib*.so"))[0]
framework = os.path.join(site, "tensorflow", "libtensorflow_framework.so.2")
def symbols(path, *flags):
    out = subprocess.check_output(["nm", "-D", *flags, path], text=True)
    return {line.split()[-1] for line in out.splitlines() if line.split() and line.split()[-1].startswith(("cuda", "__cuda"))}
needed = re.findall(r"\(NEEDED\).*\[(.+)\]", subprocess.check_output(["readelf", "-d", lib], text=True))
defined, undefined = symbols(lib, "--defined-only"), symbols(lib, "--undefined-only")
unresolved = undefined - symbols(framework, "--defined-only")
fail = []
if defined:
    fail.append(f"it defines CUDA runtime symbols (a runtime linked in): {sorted(defined)[:5]}")
if unresolved:
    fail.append(f"libtensorflow_framework.so.2 does not export {sorted(unresolved)}")
if "libtensorflow_framework.so.2" not in needed or any(n.startswith("libcudart") for n in needed):
    fail.append(f"NEEDED is {needed}")
with tempfile.NamedTemporaryFile() as f:
    subprocess.check_call(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", lib, f.name])
    fatbin = open(f.name, "rb").read()
cubins = sorted({struct.unpack_from("<I", fatbin, m.start() + 0x30)[0] & 0xFF for m in re.finditer(rb"\x7fELF", fatbin)})
ptx = sorted({f"{t.decode()} ISA {v.decode()}" for v, t in re.findall(rb"\n\.version (\d+\.\d+)\s*\n\.target (sm_\d+)", fatbin)})
if not cubins:
    fail.append("no cubin in its .nv_fatbin section")
if fail:
    sys.exit(f"install_horovod: {os.path.basename(lib)}: " + "; ".join(fail))
print(f"install_horovod: {os.path.basename(lib)}: NEEDED {', '.join(n for n in needed if 'tensorflow' in n or 'nccl' in n)}; "
      f"{len(undefined)} CUDA runtime symbols, all undefined and exported by libtensorflow_framework.so.2; "
      f"fatbin: cubins {', '.join(f'sm_{c}' for c in cubins)}; PTX {', '.join(ptx) or 'none'}")
PY
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
print(f"install_horovod: recorded for tfscale-doctor's driver check: CUDA {runtime} runtime, NVIDIA driver >= "
      f"{record['min_driver_major']} ({os.path.join(package, driver.BUILD_RECORD)})")
problems = driver.driver_problems(driver.installed_driver(), {"this Horovod build": runtime})
if problems:  # built on a GPU node whose driver cannot run it: say so now, not in every rank's abort
    sys.exit(f"install_horovod: {problems[0]}: update the driver, or build against TensorFlow's CUDA 12 (unset "
             "HOROVOD_CUDA_HOME: the default clang route, or a CUDA 12 module loaded)")
PY
fi
