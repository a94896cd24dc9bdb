"""The project's CUDA kernels (`mx.fast.cuda_kernel` sources) compiled with NVRTC on a machine without a GPU, as
each call in the runtime instantiates them: a syntax or type error shows here, not in a GPU lease.

    pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12   # any venv (270 MB)
    python -m bench.cuda_compile [--nvidia DIR] [--arch compute_90]

It runs the runtime's own kernel calls (`gather_qmv`, `delta_rule_cuda` in both forms, `top_gates`) on small
arrays with `mx.fast.cuda_kernel` replaced by a recorder, so each source is compiled with the input and output
types and template arguments those calls pass, wrapped as a `__global__` function of those parameters (the
`{name}_shape` arrays MLX adds where a source reads them as `const int*`; MLX's own wrapper differs in form, not
in what a source can use). Exit status 1 if any fails, each failure's NVRTC log printed.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import mlx.core as mx

CUDA_TYPES = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.uint32: "uint32_t",
              mx.int32: "int32_t", mx.uint8: "uint8_t"}


def recorded_calls() -> list[dict]:
    """Every kernel launch the runtime's CUDA paths make on small inputs: name, source, parameters, template."""
    from streamoe.runtime.models import delta_rule, kernels

    calls: list[dict] = []

    def cuda_kernel(name, input_names, output_names, source):
        def launch(inputs, template, output_shapes, output_dtypes, **_):
            calls.append({"name": name, "source": source, "template": template,
                          "params": [(n, a.dtype, True) for n, a in zip(input_names, inputs, strict=True)]
                          + [(n, d, False) for n, d in zip(output_names, output_dtypes, strict=True)]})
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return launch

    real, mx.fast.cuda_kernel = mx.fast.cuda_kernel, cuda_kernel
    for f in (kernels._qmv_kernel, kernels._top_gates_kernel, delta_rule._delta_rule_kernel):
        f.cache_clear()
    try:
        for dt in (mx.bfloat16, mx.float32):
            w = mx.quantize(mx.zeros((4, 128, 256)), group_size=64, bits=4)
            mats = [tuple(a if i == 0 else a.astype(dt) for i, a in enumerate(w))] * 2
            rows = mx.zeros((2,), mx.uint32)
            kernels.gather_qmv(mx.zeros((1, 256), dt), rows, rows, mats, 64)
            kernels.gather_qmv(mx.zeros((1, 256), dt), rows, rows, mats[:1], 64)
            kernels.top_gates(mx.zeros((1, 1, 256), dt), 8, True)
            kernels.top_gates(mx.zeros((3, 40), dt), 3, False)
            for warp_rows in (False, True):
                delta_rule.DELTA_RULE_WARP_ROWS = warp_rows
                B, L, hk, hv, dk, dv = 1, 3, 2, 4, 64, 32
                delta_rule.delta_rule_cuda(mx.zeros((B, L, 2 * hk, dk), dt), mx.zeros((B, L, 2 * hk * dk + hv * dv), dt),
                                           mx.zeros((B, L, hv)), mx.zeros((B, L, hv), dt), mx.zeros((B, hv, dv, dk)),
                                           hk, hv, dk, dv)
    finally:
        mx.fast.cuda_kernel, delta_rule.DELTA_RULE_WARP_ROWS = real, False
        for f in (kernels._qmv_kernel, kernels._top_gates_kernel, delta_rule._delta_rule_kernel):
            f.cache_clear()
    return calls


def template_value(v) -> str:
    if isinstance(v, mx.Dtype):
        return CUDA_TYPES[v]
    return ("true" if v else "false") if isinstance(v, bool) else str(int(v))


def wrapped(call: dict) -> str:
    params = [f"{'const ' if is_in else ''}{CUDA_TYPES[d]}* {n}" for n, d, is_in in call["params"]]
    params += [f"const int* {n}_shape" for n, _, is_in in call["params"] if is_in and f"{n}_shape" in call["source"]]
    consts = "".join(f"    constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {template_value(v)};\n"
                     for k, v in call["template"] if not isinstance(v, mx.Dtype))
    types = "".join(f"using {k} = {CUDA_TYPES[v]};\n" for k, v in call["template"] if isinstance(v, mx.Dtype))
    return ("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda/std/cstdint>\n"
            "using cuda::std::uint32_t; using cuda::std::int32_t; using cuda::std::uint8_t;\n" + types
            + f"extern \"C\" __global__ void {call['name']}({', '.join(params)}) {{\n{consts}{call['source']}\n}}\n")


def compile_source(nvrtc, source: str, includes: list[Path], arch: str) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
        return 1, "nvrtcCreateProgram failed"
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", *(f"-I{p}".encode() for p in includes)]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvidia", type=Path, help="the `nvidia` package folder of the venv holding the NVRTC wheels")
    ap.add_argument("--arch", default="compute_90", help="the virtual architecture compiled for (H100/H200: compute_90)")
    a = ap.parse_args()
    root = a.nvidia
    if root is None:
        try:
            import nvidia  # the wheels' namespace package, where they are installed beside MLX
        except ImportError:
            sys.exit("bench.cuda_compile: no NVRTC here: pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 "
                     "nvidia-cuda-cccl-cu12, or give --nvidia DIR")
        root = Path(list(nvidia.__path__)[0])
    libs = sorted((root / "cuda_nvrtc" / "lib").glob("libnvrtc.so*"))
    if not libs:
        sys.exit(f"bench.cuda_compile: {root}/cuda_nvrtc/lib holds no libnvrtc.so")
    nvrtc = ctypes.CDLL(str(libs[0]))
    includes = [root / "cuda_runtime" / "include", root / "cuda_cccl" / "include"]
    failed = 0
    for call in recorded_calls():
        rc, log = compile_source(nvrtc, wrapped(call), includes, a.arch)
        what = f"{call['name']} <{', '.join(f'{k}={template_value(v)}' for k, v in call['template'])}>"
        print(f"{'ok' if rc == 0 else 'FAILED'}  {what}" + (f"\n{log}" if rc or log.strip() else ""), flush=True)
        failed += rc != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
