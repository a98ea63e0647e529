#!/usr/bin/env python3
"""The `fatbinary` step of clang's CUDA compilation, done by CUDA 12's nvFatbin library.

    cuda_fatbinary.py LIBNVFATBIN -64 --create OUT --image=profile=sm_60,file=A.cubin ... --image=profile=compute_90,file=B.ptx

tools/cuda_build_home.sh installs this as bin/fatbinary of the CUDA 12 toolkit it assembles from pip wheels, for
clang to compile Horovod's CUDA kernels with (tools/install_horovod.sh). No pip wheel of CUDA 12 carries the
`fatbinary` program, and CUDA 13's no longer takes the --image=profile=...,file=... arguments that clang 19 passes.
nvFatbin (nvidia-nvfatbin-cu12, a documented CUDA Toolkit library since 12.4) builds the same container from the same
inputs: each cubin (from the CUDA 12 ptxas) under its sm_XX, each PTX file under its compute_XX, nothing recompiled.
Uncompressed (-compress=false), so that loading it asks no decompression of the driver.
Only what clang passes is accepted (-64, --create FILE, --image=profile=...,file=...); anything else is an error.
"""
import ctypes
import re
import sys


def main(argv):
    if len(argv) >= 2 and argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if len(argv) < 2:
        sys.exit(f"usage: {argv[0]} LIBNVFATBIN -64 --create OUT --image=profile=PROFILE,file=FILE ...")
    lib = ctypes.CDLL(argv[1])
    lib.nvFatbinGetErrorString.restype = ctypes.c_char_p
    out, images, options = None, [], ["-64", "-compress=false"]
    args = iter(argv[2:])
    for arg in args:
        if arg in ("-64", "--64"):
            continue
        if arg in ("--create", "-create"):
            out = next(args, None)
            continue
        m = re.fullmatch(r"--image=profile=(sm|compute)_(\d+[a-z]?),file=(.+)", arg)
        if not m:
            sys.exit(f"cuda_fatbinary: unsupported argument {arg!r} (this stands in for fatbinary only as clang calls it)")
        images.append(m.groups())
    if not out or not images:
        sys.exit("cuda_fatbinary: needs --create FILE and at least one --image=profile=...,file=...")

    def check(result, what):
        if result != 0:
            sys.exit(f"cuda_fatbinary: {what}: {lib.nvFatbinGetErrorString(result).decode()}")

    handle = ctypes.c_void_p()
    c_options = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    check(lib.nvFatbinCreate(ctypes.byref(handle), c_options, ctypes.c_size_t(len(options))), "nvFatbinCreate")
    for kind, arch, path in images:
        data = open(path, "rb").read()
        name = path.rsplit("/", 1)[-1].encode()
        if kind == "sm":  # a cubin from ptxas
            check(lib.nvFatbinAddCubin(handle, data, ctypes.c_size_t(len(data)), arch.encode(), name),
                  f"nvFatbinAddCubin sm_{arch} {path}")
        else:  # PTX text, kept for the driver to JIT-compile on GPUs newer than every cubin
            check(lib.nvFatbinAddPTX(handle, data + b"\0", ctypes.c_size_t(len(data) + 1), arch.encode(), name,
                                     b""), f"nvFatbinAddPTX compute_{arch} {path}")
    size = ctypes.c_size_t()
    check(lib.nvFatbinSize(handle, ctypes.byref(size)), "nvFatbinSize")
    buffer = ctypes.create_string_buffer(size.value)
    check(lib.nvFatbinGet(handle, buffer), "nvFatbinGet")
    lib.nvFatbinDestroy(ctypes.byref(handle))
    with open(out, "wb") as f:
        f.write(buffer.raw)


if __name__ == "__main__":
    main(sys.argv)
