"""The W4A8 matrix product on the CPU: 4-bit weights, activations quantized to int8 per group of 64.

    from lab import w4a8
    packed, scales, zeros = w4a8.pack(codes, scales_and_zeros)   # lab.quantize's int4 codes
    y = w4a8.matmul(x, packed, scales, zeros)                    # x [M, K] -> y [M, N], float32
    w4a8.unavailable()                                           # None, or why not on this machine

torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) multiplies bf16 activations by dequantized
weights in floating point; llama.cpp's q4_0 instead quantizes the activations to int8 per block
and multiplies integers, which AVX2 does 32 at a time (``lab/kernels/w4a8.c`` says how). torch
ships no such kernel for the CPU; torchao (on the registry) has int8-activation int4-weight CPU
kernels aimed at AVX-512 and AMX, not tried here. So it is written here, in about 100 lines of C.

It is compiled on first use with the system's C compiler (``cc``, about a second), into
``lab.weights.cache_root()/kernels``, named by a hash of its source and flags, and loaded with
ctypes: plain C needs none of torch's headers, whose build takes a minute. Compiled with
``-fopenmp`` and loaded after torch, it binds to the ``libgomp.so.1`` torch has already loaded, so its
parallel loop runs on torch's threads, as many as ``torch.get_num_threads()``, under the same wait
policy (``lab.threads``). Inside ``torch.compile`` the product is the custom op
``blocklab::w4a8_mm``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

GROUP = 64
"""Inputs sharing a weight scale and zero point, and an activation scale."""

SOURCE = Path(__file__).parent / "kernels" / "w4a8.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the W4A8 kernel needs a CPU with AVX2 and FMA; torch reports {capability}"
    try:
        _library()
    except (OSError, subprocess.CalledProcessError) as error:
        return f"the W4A8 kernel did not build with the system's C compiler: {error}"
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise OSError("no C compiler (cc, or $CC) on the PATH")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    from lab.weights import cache_root  # here: lab.weights imports lab.quantize, which imports this

    directory = cache_root() / "kernels"
    target = directory / f"w4a8-{digest}.so"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:  # processes may build at once
            built = Path(scratch) / target.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True)
            os.replace(built, target)
    library = ctypes.CDLL(str(target))
    library.w4a8_mm.restype = ctypes.c_int
    library.w4a8_mm.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # x, M, K
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # packed, scales, zeros, N
        ctypes.c_void_p,  # y
    ]  # fmt: skip
    return library


def pack(
    codes: torch.Tensor, scales_and_zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lab.quantize's int4 codes [N, K] (0..15) and scales_and_zeros [K / 64, N, 2] -> the kernel's
    packed weights [N, K / 2] uint8 and its scales and zeros, float32 [N, K / 64] each."""
    n, k = codes.shape
    halves = codes.reshape(n, k // GROUP, 2, GROUP // 2).to(torch.uint8)  # [N, G, 2, 32]
    packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()  # [N, K / 2]
    scales, zeros = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, G] each
    return packed, scales.contiguous(), zeros.contiguous()


def _matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    x = x.float().contiguous()
    m, k = x.shape
    n = packed.size(0)
    if k % GROUP or packed.shape != (n, k // 2) or packed.dtype != torch.uint8:
        raise ValueError(f"w4a8: x [M, K] with K a multiple of {GROUP} and packed [N, K/2] uint8")
    y = torch.empty(m, n)
    status = _library().w4a8_mm(
        x.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, y.data_ptr()
    )
    if status != 0:
        raise MemoryError(f"w4a8: no memory for the activations of {m} x {k}")
    return y


@torch.library.custom_op("blocklab::w4a8_mm", mutates_args=())
def _w4a8_mm(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    return _matmul(x, packed, scales, zeros)


@_w4a8_mm.register_fake
def _(x, packed, scales, zeros):
    return x.new_empty(x.size(0), packed.size(0), dtype=torch.float32)


def matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] (any float dtype) times the packed weights [N, K / 2]: y [M, N], float32."""
    if torch.compiler.is_compiling():  # dynamo cannot trace ctypes: the custom op stands for it
        return _w4a8_mm(x, packed, scales, zeros)
    return _matmul(x, packed, scales, zeros)  # eager: without the op's dispatch, a few us a call
