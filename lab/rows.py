"""Batch invariance: each row of a product computed as if it were alone (``rows_alone``).

    with rows_alone():                  # the server's decode steps (serve.engine), tests
        logits = model(idx)             # each row's logits bit for bit those it gets alone

``lab.model.Linear``, the unembedding and the tuned lens's translators ask ``taking_rows_alone()``
and, when it holds, multiply with ``matmul_rows_alone``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

ROWS_ALONE: ContextVar[bool] = ContextVar("rows_alone", default=False)
"""Batch invariance: while set (``rows_alone()``), every row of a product is computed with the kernel
a single row uses, so a row's values do not depend on how many rows share the call or what they hold."""


@contextmanager
def rows_alone() -> Iterator[None]:
    """Compute each row of a batch as if it were alone (see ``ROWS_ALONE``).

    A matrix product of many rows reduces in another order than the matrix-vector product of one
    (the BLAS picks its kernel by the row count), so a batched row differs from the same row alone in
    the last bits, and sampling can then draw another token. Under this context ``Linear`` and the
    unembedding multiply row by row with the one-row kernel (a batched matrix-vector product). The
    weight-only int8/int4 kernels (``lab.quantize``) compute rows alone anyway: they need nothing.
    """
    token = ROWS_ALONE.set(True)
    try:
        yield
    finally:
        ROWS_ALONE.reset(token)


def taking_rows_alone() -> bool:
    """Whether a product now takes each row alone: under ``rows_alone``, outside ``torch.compile``.
    Compiled code (``lab.fast``) only ever holds one sequence, whose rows are its own positions, so
    another request cannot change them; and dynamo cannot read a ContextVar."""
    return not torch.compiler.is_compiling() and ROWS_ALONE.get()


def matmul_rows_alone(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2d [N, Din] @ weight [Din, Dout] (+ bias), each row with the one-row kernel: [N, Dout]."""
    N, d_in = x2d.shape
    weights = weight.expand(N, d_in, weight.size(1))  # [N, Din, Dout], a view: no copy
    if bias is None:
        return torch.bmm(x2d[:, None], weights)[:, 0]  # [N, Dout]
    return torch.baddbmm(bias.expand(N, 1, -1), x2d[:, None], weights)[:, 0]  # [N, Dout]
