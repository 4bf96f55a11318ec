"""What a measurement ran on: the CPU's model and the vector units its speed hinges on."""

from __future__ import annotations

import platform
from pathlib import Path

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
