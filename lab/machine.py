"""What a measurement runs on: the device a command is given (``--device``), the CPU's model and the
vector units its speed hinges on."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Literal

from lab.errors import UserError

Device = Literal["auto", "cpu", "cuda"]
"""``--device``: auto takes the first CUDA device where torch sees one, else the CPU."""


def device_named(choice: str, dtype: str = "float32") -> str:
    """The torch device of ``--device choice`` for weights of ``dtype``: ``cuda:0`` or ``cpu`` for auto,
    the CPU for the integer kinds (``lab.quantize.QUANTIZED_DTYPES``, CPU kernels), which cuda refuses;
    cuda where torch sees no CUDA device is a UserError that says so (a CPU wheel of torch sees none)."""
    import torch

    from lab.quantize import QUANTIZED_DTYPES

    if choice not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device: auto, cpu or cuda, not {choice!r}")
    if dtype in QUANTIZED_DTYPES:
        if choice == "cuda":
            raise UserError(f"--dtype {dtype} runs on the CPU: use --device cpu (or auto)")
        return "cpu"
    if choice == "cpu" or choice == "auto" and not torch.cuda.is_available():
        return "cpu"
    missing = missing_accelerator("cuda")
    if missing is not None:
        raise UserError(f"--device cuda: {missing}")
    return "cuda:0"


def missing_accelerator(kind: str) -> str | None:
    """Why torch cannot run on ``kind`` (``cuda``, ``mps``) here, or None where it can (or ``kind``
    needs no device: ``cpu``, ``auto``)."""
    if kind not in ("cuda", "mps"):
        return None
    import torch

    if kind == "cuda" and not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return f"torch {torch.__version__} ({build}) sees no CUDA device"
    if kind == "mps" and not torch.backends.mps.is_available():
        return f"torch {torch.__version__} sees no MPS device (Apple silicon's GPU)"
    return None


VECTOR_UNITS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The x86 flags that decide torch's CPU kernels: fp32 at AVX2 or AVX-512 width, bf16 in hardware."""


def cpu_description() -> str:
    """The CPU's model and its widest vector units (bf16 and fp32 speeds hinge on them), from Linux's
    /proc/cpuinfo; the architecture elsewhere."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    model = fields.get("model name\t", platform.machine()).strip()
    flags = set(fields.get("flags\t\t", "").split())
    units = [name for name in VECTOR_UNITS if name in flags]
    return f"{model} ({', '.join(units) or 'no AVX2'})"
