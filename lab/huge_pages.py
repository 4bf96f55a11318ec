"""A model's weights in transparent huge pages, where the kernel gives them.

    moved = hold_in_huge_pages(model)   # bytes now in 2 MiB pages (0: this machine gives none)

A decode step reads every weight once, hundreds of megabytes at GPT-2 small's shapes, in 4 KiB pages
unless asked otherwise: a page-table walk every 4 KiB of the stream, which the products' prefetching
does not hide. Linux backs an anonymous private mapping with 2 MiB pages when the mapping asks
(``madvise(MADV_HUGEPAGE)``, or always, per ``/sys/kernel/mm/transparent_hugepage/enabled``); torch's
allocator does not ask. ``lab.weights.load_model`` moves a CPU model's large tensors into one such
mapping once they are in their final layout (quantized, packed). The values, shapes and strides are
the same; only where they lie changes, and the heap's pages the old storages leave go back to the
system. docs/inference.md has what it saves.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch
from torch import nn

SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PAGE = 2 << 20
"""A huge page's bytes (x86's PMD size), the mapping's alignment."""
SMALLEST = 1 << 20
"""Storages from this many bytes move; smaller ones (norms, biases) are read from cache anyway."""


def available() -> bool:
    """Whether an anonymous mapping that asks gets huge pages here: Linux with transparent huge pages
    on ``madvise`` or ``always``."""
    try:
        setting = SETTING.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[madvise]" in setting or "[always]" in setting)


def hold_in_huge_pages(model: nn.Module) -> int:
    """Move the storages of ``model``'s CPU parameters and buffers of ``SMALLEST`` bytes or more into
    one anonymous mapping in huge pages, every tensor on them keeping its shape, strides and values;
    the bytes moved (0 where ``available`` is False). Tensors outside the parameters and buffers that
    share a moved storage keep the old one (the same values)."""
    if not available():
        return 0
    shared: dict[int, list[torch.Tensor]] = {}  # storage address -> the tensors on it
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if tensor.device.type != "cpu" or storage.nbytes() < SMALLEST:
            continue
        shared.setdefault(storage.data_ptr(), []).append(tensor)
        storages[storage.data_ptr()] = storage
    if not shared:
        return 0
    sizes = {address: -(-storages[address].nbytes() // 4096) * 4096 for address in shared}
    region = mmap.mmap(-1, sum(sizes.values()) + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(region, dtype=torch.uint8)  # it holds the mapping open
    offset = (-base.data_ptr()) % PAGE
    with torch.no_grad():
        for address, tensors in shared.items():
            old = torch.empty(0, dtype=torch.uint8).set_(storages[address])  # [nbytes]
            base[offset : offset + old.numel()].copy_(old)
            for tensor in tensors:
                start = offset // tensor.element_size() + tensor.storage_offset()
                moved = torch.empty(0, dtype=tensor.dtype).set_(
                    base.untyped_storage(), start, tensor.shape, tensor.stride()
                )
                tensor.data = moved
            offset += sizes[address]
    moved_bytes = sum(storages[address].nbytes() for address in shared)
    del storages, shared, old  # the old storages go now, before the heap is trimmed
    _return_freed_memory()
    return moved_bytes


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``): the storages just
    left, and a quantized model's bf16 weights before them, would otherwise stay in the process's
    resident memory, free but kept by malloc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
