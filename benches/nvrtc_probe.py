#!/usr/bin/env python3
"""Where a cubecl kernel's compile time goes, kernel by kernel, outside cubecl.

Reads the CUDA sources a Burn process compiled from cubecl's compilation log at level `full`
(each between `[START_KERNEL_COMPILATION]` and `[END_KERNEL_COMPILATION]`), takes a random
sample (fixed seed) and compiles each again with NVRTC the way cubecl-cuda 0.11.3 does
(`--gpu-architecture=sm_XXa`, the CUDA and CCCL include folders, `-lineinfo`), timing:

- `ptx`: NVRTC to PTX (what cubecl asks for), then `load`: the driver's JIT of that PTX to the
  GPU's code (`cuModuleLoadData`, the driver's disk cache off), the two steps cubecl takes;
- for a kernel whose two steps take under `--alternatives-below` seconds: `cubin` (NVRTC
  straight to the GPU's code) and its load, `no_lineinfo`, `pch` (`-pch` on the source as
  cubecl writes it) and `prelude` (the source's `#include` lines alone: what its headers cost);
- `parallel_N`: every kernel's `ptx` + `load` on N threads at once, the wall time.

`--pch` measures instead, for each kernel with two or more includes: the source as written,
the source with its includes moved first, and that with NVRTC's automatic precompiled headers
(`-pch`) twice in turn, with NVRTC's PCH status and messages (whether one kernel's header is
reused by the next).

Prints one JSON line per kernel and a summary line. Needs libnvrtc and a GPU's driver.

    python3 nvrtc_probe.py --log compile.log [--threads 4,16] [--limit 80] [--pch]
"""

import argparse
import ctypes
import glob
import json
import os
import random
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("CUDA_CACHE_DISABLE", "1")


def load(patterns):
    for pattern in patterns:
        for path in sorted(glob.glob(pattern), reverse=True) or [pattern]:
            try:
                return ctypes.CDLL(path)
            except OSError:
                pass
    sys.exit(f"nvrtc_probe: none of {patterns} loads")


cuda_home = os.environ.get("CUDA_PATH", "/usr/local/cuda")
nvrtc = load([f"{cuda_home}/lib64/libnvrtc.so*"])
# The driver by its soname (the loader's search), never the toolkit's stub.
cuda = load(["libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1"])


def check_cu(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: CUresult {status}")


def sources(log):
    text = open(log, errors="replace").read()
    found = re.findall(r"\[START_KERNEL_COMPILATION\](.*?)\[END_KERNEL_COMPILATION\]", text, re.S)
    out = []
    for block in found:
        name = re.search(r"\nname: (.*)", block)
        src = re.search(r"source:\n```[a-z]*\n(.*)\n```", block, re.S)
        if src:
            out.append(((name.group(1).strip() if name else "?")[:120], src.group(1)))
    return out


def arch():
    dev = ctypes.c_int()
    check_cu(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    major, minor = ctypes.c_int(), ctypes.c_int()
    check_cu(cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev), "major")
    check_cu(cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev), "minor")
    version = major.value * 10 + minor.value
    return dev, version


def options(version, lineinfo=True, extra=()):
    opts = [f"--gpu-architecture=sm_{version}{'a' if version >= 90 else ''}",
            f"--include-path={cuda_home}/include"]
    if os.path.exists(f"{cuda_home}/include/cccl"):
        opts.append(f"--include-path={cuda_home}/include/cccl")
    if lineinfo:
        opts.append("-lineinfo")
    opts.extend(extra)
    return opts


def compile_program(src, opts, output="ptx"):
    """Compiles `src` with NVRTC: its time in seconds, the status, the PCH creation status,
    the program log and the output bytes (`output`: "ptx" or "cubin"; None where it failed)."""
    prog = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), None, 0, None, None)
    if status != 0:
        raise RuntimeError(f"nvrtcCreateProgram {status}")
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    started = time.perf_counter()
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    took = time.perf_counter() - started
    # NVRTC before 12.8 has no precompiled headers (and no status to ask).
    create = (nvrtc.nvrtcGetPCHCreateStatus(prog)
              if hasattr(nvrtc, "nvrtcGetPCHCreateStatus") else None)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace")
    data = None
    if status == 0:
        get_size = nvrtc.nvrtcGetPTXSize if output == "ptx" else nvrtc.nvrtcGetCUBINSize
        get = nvrtc.nvrtcGetPTX if output == "ptx" else nvrtc.nvrtcGetCUBIN
        get_size(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        get(prog, buf)
        data = buf.raw
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return took, status, create, log, data


def compile_source(src, opts, output="ptx"):
    """NVRTC's time in seconds and the output bytes (None, its log printed, when it fails)."""
    took, status, _, log, data = compile_program(src, opts, output)
    if status != 0:
        print(json.dumps({"nvrtc_error": log[:400]}), flush=True)
    return took, data


def load_module(image):
    module = ctypes.c_void_p()
    started = time.perf_counter()
    check_cu(cuda.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
    took = time.perf_counter() - started
    cuda.cuModuleUnload(module)
    return took


def is_include(line):
    return line.lstrip().startswith("#include")


def includes(src):
    """The `#include` lines of `src`, in order."""
    return [line for line in src.splitlines() if is_include(line)]


def hoisted(src):
    """`src` with its `#include` lines moved to the top, above cubecl's typedefs: NVRTC's
    automatic precompiled header covers only includes that start the program."""
    rest = [line for line in src.splitlines() if not is_include(line)]
    return "\n".join(includes(src) + rest) + "\n"


def pch_status(src, opts):
    """NVRTC's time, the PCH creation status and the program log, compiling `src` to PTX."""
    took, status, create, log, _ = compile_program(src, opts)
    return took, status, create, log[-600:]


def pch_mode(kernels, version):
    """The kernels with headers, each hoisted (includes first) and compiled without and then
    with `-pch`, in turn: whether a header built by one is reused by the next."""
    heap = ctypes.c_size_t()
    nvrtc.nvrtcGetPCHHeapSize(ctypes.byref(heap))
    print(json.dumps({"pch_heap_bytes": heap.value}), flush=True)
    with_headers = [(n, s) for n, s in kernels if len(includes(s)) >= 2]
    for index, (name, src) in enumerate(with_headers):
        row = {"pch_kernel": index, "name": name[:80]}
        row["plain_s"], row["plain_status"], _, _ = pch_status(src, options(version))
        row["hoisted_s"], row["hoisted_status"], _, log = pch_status(hoisted(src), options(version))
        if row["hoisted_status"] != 0:
            row["hoisted_log"] = log
        extra = ["-pch", "--pch-verbose=true"]
        took, status, create, log = pch_status(hoisted(src), options(version, extra=extra))
        row.update({"pch_s": round(took, 4), "pch_status": status, "pch_create": create,
                    "pch_log": log[-300:]})
        took, status, create, log = pch_status(hoisted(src), options(version, extra=extra))
        row.update({"pch_again_s": round(took, 4), "pch_again_create": create,
                    "pch_again_log": log[-300:]})
        for key in ("plain_s", "hoisted_s"):
            row[key] = round(row[key], 4)
        print(json.dumps(row), flush=True)


def prelude(src):
    return "\n".join(includes(src)) + "\n__global__ void probe_empty() {}\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--threads", default="4,8,16")
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--pch", action="store_true",
                        help="only the precompiled-header comparison (hoisted includes)")
    parser.add_argument("--alternatives-below", type=float, default=5.0,
                        help="time the alternatives only for kernels whose ptx + load is shorter")
    parser.add_argument("--deadline", type=float, default=400, help="seconds for the whole run")
    args = parser.parse_args()
    started = time.perf_counter()
    check_cu(cuda.cuInit(0), "cuInit")
    dev, version = arch()
    ctx = ctypes.c_void_p()
    check_cu(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check_cu(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    # A random sample (fixed seed) of the logged kernels, in random order: the log is in the
    # order compiled (elementwise kernels first, then tuning's candidates).
    kernels = sources(args.log)
    total = len(kernels)
    random.Random(0).shuffle(kernels)
    kernels = kernels[: args.limit]
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    print(json.dumps({"kernels_logged": total, "kernels": len(kernels), "sm": version,
                      "nvrtc": f"{major.value}.{minor.value}"}), flush=True)
    if args.pch:
        pch_mode(kernels, version)
        return
    rows = []
    for index, (name, src) in enumerate(kernels):
        if time.perf_counter() - started > args.deadline * 0.6:
            print(json.dumps({"stopped_at_kernel": index}), flush=True)
            break
        row = {"kernel": index, "name": name, "source_bytes": len(src),
               "includes": len(includes(src))}
        took, ptx = compile_source(src, options(version))
        row["ptx_s"] = round(took, 4)
        if ptx is None:
            row["error"] = True
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        row["ptx_bytes"] = len(ptx)
        row["load_s"] = round(load_module(ptx), 4)
        if row["ptx_s"] + row["load_s"] > args.alternatives_below:
            # A long kernel: which step is long is the question; the alternatives would take
            # minutes.
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        took, cubin = compile_source(src, options(version), output="cubin")
        row["cubin_s"] = round(took, 4)
        row["cubin_load_s"] = round(load_module(cubin), 4) if cubin else None
        row["no_lineinfo_s"] = round(compile_source(src, options(version, lineinfo=False))[0], 4)
        row["pch_s"] = round(compile_source(src, options(version, extra=["-pch"]))[0], 4)
        row["prelude_s"] = round(compile_source(prelude(src), options(version))[0], 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    done = [r for r in rows if "load_s" in r]
    summary = {"summary": True, "kernels": len(done)}
    for key in ("ptx_s", "load_s", "cubin_s", "cubin_load_s", "no_lineinfo_s", "pch_s", "prelude_s"):
        values = [r[key] for r in done if r.get(key) is not None]
        if values:
            summary[key + "_sum"] = round(sum(values), 2)
            summary[key + "_median"] = round(statistics.median(values), 4)
    sequential = sum(r["ptx_s"] + r["load_s"] for r in done)
    summary["sequential_ptx_plus_load_s"] = round(sequential, 2)
    srcs = [src for (_, src), r in zip(kernels, rows) if "load_s" in r]

    def one(src):
        cuda.cuCtxSetCurrent(ctx)
        took, ptx = compile_source(src, options(version))
        return took + (load_module(ptx) if ptx else 0.0)

    for n in [int(t) for t in args.threads.split(",") if t]:
        if time.perf_counter() - started > args.deadline * 0.85 - sequential / max(n, 1):
            summary[f"parallel_{n}_s"] = "skipped: deadline"
            continue
        wall = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            per = list(pool.map(one, srcs))
        summary[f"parallel_{n}_s"] = round(time.perf_counter() - wall, 2)
        summary[f"parallel_{n}_per_kernel_sum_s"] = round(sum(per), 2)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    threading.current_thread().name = "nvrtc_probe"
    main()
