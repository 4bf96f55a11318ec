"""lab.huge_pages: a model's large storages moved into one mapping in huge pages keep every tensor's
values, shape, strides and sharing, and the kernel backs them with 2 MiB pages where it gives them."""

from pathlib import Path

import pytest
import torch
from torch import nn

from lab import huge_pages
from lab.huge_pages import hold_in_huge_pages


class Held(nn.Module):
    """A large weight kept transposed (as lab.float_kernels keeps its weights), a buffer that is a view
    of it, and a small bias that stays where it is."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(
            torch.randn(1024, 768, generator=generator).t()
        )  # [768, 1024], strides (1, 768)
        self.register_buffer("rows", self.weight.detach()[:, 100:200])  # a view on the weight's storage
        self.bias = nn.Parameter(torch.randn(1024, generator=generator))  # 4 KiB: stays


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this machine")
def test_large_storages_move_into_huge_pages_and_keep_their_tensors():
    module = Held()
    weight, rows, bias = module.weight.detach().clone(), module.rows.clone(), module.bias.detach().clone()
    bias_at, stride = module.bias.data_ptr(), module.weight.stride()
    moved = hold_in_huge_pages(module)
    assert moved == 1024 * 768 * 4  # the weight's storage alone; the bias is under SMALLEST
    assert torch.equal(module.weight, weight) and module.weight.stride() == stride
    assert torch.equal(module.rows, rows)
    assert (
        module.rows.untyped_storage().data_ptr() == module.weight.untyped_storage().data_ptr()
    )  # still shared
    assert module.bias.data_ptr() == bias_at and torch.equal(module.bias, bias)
    assert isinstance(module.weight, nn.Parameter) and module.weight.requires_grad
    assert anon_huge_kib(module.weight.data_ptr()) >= 2048  # at least one 2 MiB page backs it
    module.weight.data.mul_(2)  # writable, as any parameter
    assert torch.equal(module.rows, 2 * rows)


def test_nothing_moves_where_the_machine_gives_no_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    module = Held()
    at = module.weight.data_ptr()
    assert hold_in_huge_pages(module) == 0 and module.weight.data_ptr() == at
