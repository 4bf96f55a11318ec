"""Integer matrix products on the CPU: activations quantized to int8 per group of 64, 4- or 8-bit weights.

    from lab import intmm
    packed, scales_zeros = intmm.w4a8_pack(codes, scales_and_zeros)    # lab.quantize's int4 codes
    y = intmm.w4a8_matmul(x, packed, scales_zeros, bias, n)             # x [M, K] -> y [M, N]
    y = intmm.w8a8_matmul(x, values, scales, bias)                     # lab.quantize's int8 rows
    y = intmm.int4_matmul(x, packed, scales_zeros, bias, n)             # weight-only: x as it is
    y = intmm.int8_matmul(x, values, bf16_scales, bias)                 # weight-only int8 rows
    y = intmm.attend_rows(qkv, k_caches, v_caches, positions, n_head)  # decode attention, every row
    out = intmm.block_rows(BlockWeights(...), x, k_caches, v_caches, positions)  # a whole block's step
    index = intmm.argmax(logits)                                       # greedy decoding's pick, an int
    intmm.unavailable()                                                # None, or why not here
    intmm.instruction_set()                                            # "avx2" or "avx512-vnni"

torch's int4 and int8 kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) multiply
bf16 activations by weights widened to floating point; llama.cpp's q4_0 and q8_0 instead quantize the
activations to int8 per block and multiply integers, which AVX2 does 32 at a time and AVX-512 VNNI
64 at a time in one instruction (``lab/kernels/intmm.c`` says how, for both products in both).
torch ships no such kernel for the CPU; torchao (on the registry) has int8-activation CPU kernels
aimed at AVX-512 and AMX, not tried here. So they are written here, in one C file, which picks the
instruction set when it loads (``instruction_set``). The same file has weight-only products of
the same weights (``int4_matmul``, ``int8_matmul``: the weights widened to float32, the activations
as they are), which stream a decode step's weights faster than torch's weight-only kernels;
lab.quantize's int4 and int8 use them where they build.

x, the bias and y are float32 or bfloat16 (the model's activations), read and written as they are;
other dtypes are taken as float32. The bias is added before y is rounded to bf16.

The C file is compiled on first use with the system's C compiler (``cc``, about a second), into
``lab.weights.cache_root()/kernels``, named by a hash of its source and flags, and loaded with
ctypes: plain C needs none of torch's headers, whose build takes a minute. Compiled with
``-fopenmp`` and loaded after torch, it binds to the ``libgomp.so.1`` torch has already loaded, so its
parallel loops run on torch's threads, as many as ``torch.get_num_threads()``, under the same wait
policy (``lab.threads``). Inside ``torch.compile`` each product is a custom op,
``blocklab::w4a8_mm``, ``blocklab::w8a8_mm``, ``blocklab::int4_mm`` and ``blocklab::int8_mm``.

The same file holds the float32 and bf16 products (``lab.float_kernels``), a decode step's
attention (``attend_rows``), a whole pre-LN block for a decode step's rows in one call (``block_rows``),
a run of blocks over one sequence's tokens in one call (``stack_rows``), a decode step's rows through
their own block sets in one call (``step_rows``), a speculation draft's step in one call
(``draft_row``; these five behind ``lab.block_kernel``), greedy decoding's ``argmax``
and a token's log-probability's ``logsumexp``: what a decode
step spent in torch's slower kernels, at sizes where a call into torch costs more than the work.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

GROUP = 64
"""Inputs sharing an activation scale (and in w4a8, a weight scale and zero point)."""
INSTRUCTION_SETS = ("avx2", "avx512-vnni")
"""What the kernels are written in; the library takes the last one this CPU has."""

SOURCE = Path(__file__).parent / "kernels" / "intmm.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


@dataclass(frozen=True)
class _Kernel:
    """One product of lab/kernels/intmm.c: its C function ``name`` takes x, M, K, bf16, then the
    ``weights`` (dense tensors of ``dtypes``, the first [N rounded up to ``n_multiple``, K /
    codes_per_byte]), then N, bias and y; under torch.compile it is the custom op
    ``blocklab::<name>``."""

    name: str
    weights: tuple[str, ...]
    codes_per_byte: int
    dtypes: tuple[torch.dtype, ...]
    k_multiple: int = GROUP
    n_multiple: int = 1
    op: torch.library.CustomOpDef = field(init=False, repr=False)

    def __post_init__(self) -> None:
        arguments = ", ".join(f"Tensor {weight}" for weight in self.weights)
        op = torch.library.custom_op(
            f"blocklab::{self.name}",
            lambda x, *rest: self.product(x, rest[:-2], *rest[-2:]),
            mutates_args=(),
            schema=f"(Tensor x, {arguments}, Tensor? bias, int n) -> Tensor",
        )
        op.register_fake(lambda x, *rest: x.new_empty(x.size(0), rest[-1], dtype=_y_dtype(x)))
        object.__setattr__(self, "op", op)

    def __call__(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None, n: int):
        if torch.compiler.is_compiling():  # dynamo cannot trace ctypes: the custom op stands for it
            return self.op(x, *weights, bias, n)
        return self.product(x, weights, bias, n)  # eager: without the op's dispatch, a few us a call

    def product(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None, n: int):
        dtype = x.dtype
        if dtype is not torch.bfloat16 and dtype is not torch.float32:
            x, dtype = x.float(), torch.float32
        if not x.is_contiguous():
            x = x.contiguous()
        m, k = x.shape
        self.check(k, weights, n, f"{list(x.shape)}")
        if bias is not None and bias.dtype is not dtype:
            bias = bias.to(dtype)
        y = torch.empty(m, n, dtype=dtype)
        status = _function(self.name)(
            x.data_ptr(), m, k, dtype is torch.bfloat16, *[w.data_ptr() for w in weights], n,
            None if bias is None else bias.data_ptr(), y.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError(f"{self.name}: no memory for the activations of {m} x {k}")
        return y

    def check(self, k: int, weights: tuple[torch.Tensor, ...], n: int, x: str) -> None:
        """Raise unless ``weights`` are what the C function reads for inputs of width ``k`` and ``n``
        outputs (``x``: the inputs' shape, for the message)."""
        rows, width = weights[0].shape
        wrong = len(weights) != len(self.dtypes)
        for weight, wanted in zip(weights, self.dtypes, strict=False):  # a loop, not any(): 49 calls a step
            wrong = wrong or weight.dtype is not wanted or not weight.is_contiguous()
        unpadded = rows != -(-n // self.n_multiple) * self.n_multiple
        if k % self.k_multiple or width * self.codes_per_byte != k or wrong or unpadded:  # C reads them so
            named = ", ".join(f"{name} {kind}" for name, kind in zip(self.weights, self.dtypes, strict=True))
            rounded = "N" if self.n_multiple == 1 else f"N rounded up to {self.n_multiple}"
            expected = f"{self.weights[0]} [{rounded}, K / {self.codes_per_byte}], dense: {named}"
            got = f"{x}, N {n} and {', '.join(f'{list(w.shape)} {w.dtype}' for w in weights)}"
            widths = f"K a multiple of {self.k_multiple}"
            raise ValueError(f"{self.name}: x [M, K] with {widths} and {expected}, got {got}")


@functools.cache
def _function(name: str) -> ctypes._CFuncPtr:
    """lab/kernels/intmm.c's function ``name``, looked up once: a ctypes attribute lookup at every call
    is a share of a small product's cost."""
    return getattr(_library(), name)


def _y_dtype(x: torch.Tensor) -> torch.dtype:
    """The kernels read and write bf16 and float32; any other dtype is taken as float32."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


_W4A8 = _Kernel("w4a8_mm", ("packed", "scales_zeros"), 2, (torch.uint8, torch.bfloat16), n_multiple=16)
_W8A8 = _Kernel("w8a8_mm", ("values", "scales"), 1, (torch.int8, torch.float32))
_BF16 = _Kernel("bf16_mm", ("weight",), 1, (torch.bfloat16,), k_multiple=1)
_F32 = _Kernel("f32_mm", ("weight",), 1, (torch.float32,), k_multiple=1)
_INT8 = _Kernel("int8_mm", ("values", "scales"), 1, (torch.int8, torch.bfloat16), k_multiple=1)
_INT4 = _Kernel("int4_mm", ("packed", "scales_zeros"), 2, (torch.uint8, torch.bfloat16), n_multiple=16)


def unavailable() -> str | None:
    """Why the kernels cannot run here (None: they can)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the integer kernels need a CPU with AVX2 and FMA; torch reports {capability}"
    try:
        _library()
    except (OSError, subprocess.CalledProcessError) as error:
        return f"the integer kernels did not build with the system's C compiler: {error}"
    return None


def instruction_set(choose: str | None = None) -> str:
    """The instruction set the products use, of ``INSTRUCTION_SETS``; ``choose`` one to use it from
    now on, in this process (a CPU without AVX-512 VNNI keeps AVX2): to compare the two on one CPU."""
    if choose is not None and choose not in INSTRUCTION_SETS:
        raise ValueError(f"instruction set: one of {', '.join(INSTRUCTION_SETS)}, not {choose!r}")
    request = -1 if choose is None else INSTRUCTION_SETS.index(choose)
    return INSTRUCTION_SETS[_library().intmm_isa(request)]


@functools.cache
def _library(source_file: Path = SOURCE) -> ctypes.CDLL:
    """The kernels built from ``source_file`` (another version of it: scripts/bench_kernel_change.py),
    cached by the source's digest."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise OSError("no C compiler (cc, or $CC) on the PATH")
    source = source_file.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    from lab.weights import cache_root  # here: lab.weights imports lab.quantize, which imports this

    directory = cache_root() / "kernels"
    target = directory / f"intmm-{digest}.so"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:  # processes may build at once
            built = Path(scratch) / target.name
            command = [compiler, *FLAGS, str(source_file), "-o", str(built)]
            subprocess.run(command, check=True, capture_output=True)
            os.replace(built, target)
    library = ctypes.CDLL(str(target))
    library.intmm_isa.restype, library.intmm_isa.argtypes = ctypes.c_int, [ctypes.c_int]
    library.argmax.restype = ctypes.c_int64
    library.argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]  # x, n, bf16
    library.multiply_add_rate.restype = ctypes.c_double
    library.multiply_add_rate.argtypes = [ctypes.c_int64]  # turns
    library.logsumexp.restype = ctypes.c_float
    library.logsumexp.argtypes = [ctypes.c_void_p, ctypes.c_int64]  # x, n
    library.attend_rows.restype = ctypes.c_int
    library.attend_rows.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 6
    library.block_rows.restype = ctypes.c_int
    library.block_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int] + [ctypes.c_void_p] * 7
    library.stack_rows.restype = ctypes.c_int
    library.stack_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    library.stack_rows.argtypes += [ctypes.c_void_p] * 7
    library.step_rows.restype = ctypes.c_int
    library.step_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    library.step_rows.argtypes += [ctypes.c_void_p] * 11
    library.draft_row.restype = ctypes.c_int64
    library.draft_row.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    library.draft_row.argtypes += [ctypes.c_int64] + [ctypes.c_void_p] * 6
    for kernel in (_W4A8, _W8A8, _BF16, _F32, _INT8, _INT4):
        function = getattr(library, kernel.name)
        function.restype = ctypes.c_int
        function.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,  # x, M, K, bf16
            *[ctypes.c_void_p] * len(kernel.weights),
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # N, bias, y
        ]  # fmt: skip
    return library


def w4a8_pack(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lab.quantize's int4 codes [N, K] (0..15) and scales_and_zeros [K / 64, N, 2] -> the kernel's
    layout (lab/kernels/intmm.c): the outputs in blocks of 16 (N padded with zeros to a multiple of
    16), packed weights [N16 * 16, K / 2] uint8 holding [N16, K / 64, 8, 64] bytes, and the blocks'
    scales and zeros [N16, K / 64, 2, 16] in bf16, as torch's int4 kernel keeps them: the same
    weights as int4."""
    n, k = codes.shape
    blocks, groups = -(-n // 16), k // GROUP
    padding = blocks * 16 - n
    codes = torch.cat([codes.to(torch.uint8), codes.new_zeros(padding, k, dtype=torch.uint8)])  # [N16*16, K]
    runs = codes.view(blocks, 16, groups, 8, 2, 4).permute(0, 2, 3, 4, 1, 5)  # [N16, G, 8, half, 16, 4]
    packed = (runs[:, :, :, 0] | (runs[:, :, :, 1] << 4)).reshape(blocks * 16, k // 2)  # [N16*16, K / 2]
    pairs = torch.cat([scales_and_zeros, scales_and_zeros.new_zeros(groups, padding, 2)], 1)  # [G, N16*16, 2]
    scales_zeros = pairs.to(torch.bfloat16).view(groups, blocks, 16, 2).permute(1, 0, 3, 2)  # [N16, G, 2, 16]
    return packed.contiguous(), scales_zeros.contiguous()


def w4a8_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
    n: int | None = None,
) -> torch.Tensor:
    """x [M, K] times the packed 4-bit weights and their bf16 scales and zeros (``w4a8_pack``), +
    bias [N]: y [M, N], N ``n`` (default: the packed rows, N rounded up to 16)."""
    return _W4A8(x, (packed, scales_zeros), bias, packed.size(0) if n is None else n)


def w8a8_matmul(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] times lab.quantize's int8 rows, values [N, K] int8 and scales [N] float32, + bias [N]:
    y [M, N]."""
    return _W8A8(x, (values, scales), bias, values.size(0))


def int8_matmul(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] times weight-only int8 rows, values [N, K] int8 and scales [N] bf16 (the weight
    values * scales, as torch's int8 kernel takes them), + bias [N]: y [M, N], summed in float32 with
    the inputs as they are. Any K."""
    return _INT8(x, (values, scales), bias, values.size(0))


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
    n: int | None = None,
) -> torch.Tensor:
    """x [M, K] times the packed 4-bit weights of ``w4a8_pack`` + bias [N], weight-only: y [M, N],
    summed in float32 with the inputs as they are (``w4a8_matmul``'s arguments)."""
    return _INT4(x, (packed, scales_zeros), bias, packed.size(0) if n is None else n)


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], rounded to bf16, times bf16 weights [N, K] (a Linear's, laid out [out, in]) + bias [N]:
    y [M, N], summed in float32. Any K."""
    return _BF16(x, (weight,), bias, weight.size(0))


def f32_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times float32 weights [N, K] + bias [N]: y [M, N], summed in float32. Any K."""
    return _F32(x, (weight,), bias, weight.size(0))


def attend_rows(
    qkv: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], positions: list[int],
    n_head: int,
) -> torch.Tensor:  # fmt: skip
    """Decode attention, every row in one call: row b of qkv [B, 3D] (its query, key and value) writes
    its key and value at ``positions[b]`` of its own caches ``k_caches[b]``, ``v_caches[b]`` (dense
    [1, H, T_max, Dh] or [H, T_max, Dh] each, any T_max) and its query reads positions
    0..positions[b] there: y [B, D], the heads side by side. float32 or bf16 throughout; each row
    computed as if alone (batch-invariant)."""
    B, three_d = qkv.shape
    D = three_d // 3
    dtype = qkv.dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16 or not qkv.is_contiguous():
        raise ValueError(f"attend_rows: qkv dense float32 or bf16 [B, 3D], got {dtype} {list(qkv.shape)}")
    caches = _caches("attend_rows", k_caches, v_caches, positions, n_head, D // n_head, dtype)
    y = torch.empty(B, D, dtype=dtype)
    status = _function("attend_rows")(
        B, n_head, D // n_head, dtype is torch.bfloat16, qkv.data_ptr(), *caches, y.data_ptr()
    )
    if status != 0:
        raise MemoryError(f"attend_rows: no memory for the scores of {B} rows")
    return y


def _caches(
    name: str, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], positions: list[int], n_head: int,
    head_dim: int, dtype: torch.dtype,
) -> tuple[ctypes.Array, ...]:  # fmt: skip
    """The rows' caches as the C attention reads them: their keys' and values' pointers, lengths and
    positions, once each checked to be dense [1, H, T_max, Dh] (or [H, T_max, Dh]) of ``dtype``."""
    lengths = []
    for k_cache, v_cache, position in zip(k_caches, v_caches, positions, strict=True):
        t_max = k_cache.size(-2)
        shape = (n_head, t_max, head_dim)
        for cache in (k_cache, v_cache):  # C reads a row's values with its keys' T_max
            if cache.dtype is not dtype or not cache.is_contiguous() or cache.shape[-3:] != shape:
                expected = f"dense {dtype} [1, {n_head}, {t_max}, {head_dim}]"
                raise ValueError(f"{name}: caches {expected}, got {cache.dtype} {list(cache.shape)}")
        if not 0 <= position < t_max:
            raise ValueError(f"{name}: position {position} outside a cache of {t_max}")
        lengths.append(t_max)
    B = len(positions)
    pointers, integers = ctypes.c_void_p * B, ctypes.c_int64 * B
    keys, values = pointers(*[k.data_ptr() for k in k_caches]), pointers(*[v.data_ptr() for v in v_caches])
    return keys, values, integers(*lengths), integers(*positions)


class _Linear(ctypes.Structure):
    """lab/kernels/intmm.c's ``struct linear``: one product of a block."""

    _fields_ = [
        ("kind", ctypes.c_int64), ("k", ctypes.c_int64), ("n", ctypes.c_int64),
        ("weights", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p),
    ]  # fmt: skip


class _BlockWeights(ctypes.Structure):
    """lab/kernels/intmm.c's ``struct block_weights``."""

    _fields_ = [
        *[(name, _Linear) for name in ("c_attn", "attn_proj", "c_fc", "mlp_proj")],
        *[(name, ctypes.c_void_p) for name in ("ln_1_weight", "ln_1_bias", "ln_2_weight", "ln_2_bias")],
        ("eps", ctypes.c_double), ("n_head", ctypes.c_int64), ("head_dim", ctypes.c_int64),
    ]  # fmt: skip


PRODUCTS = {"f32": _F32, "bf16": _BF16, "w4a8": _W4A8, "w8a8": _W8A8, "int8": _INT8, "int4": _INT4}
"""The products a block in one call (``block_rows``) can hold, in lab/kernels/intmm.c's order."""

Product = tuple[str, tuple[torch.Tensor, ...], torch.Tensor | None, int]
"""A product of ``PRODUCTS`` as ``BlockWeights`` takes it: (kind, its weights as the kind's matmul
takes them, the bias or None, N)."""


class BlockWeights:
    """A pre-LN (GPT-2) block's weights as ``block_rows`` reads them: c_attn, attn_proj, c_fc and
    mlp_proj (each a ``Product``), the two LayerNorms' weights and biases (dense [D]), their eps, the
    heads. It holds the tensors, so their memory lives as long as it does. ``dtype``: the activations'
    (float32 or bf16), as every norm parameter and bias must be; an integer product takes bf16."""

    def __init__(
        self, products: list[Product], norms: list[tuple[torch.Tensor, torch.Tensor | None]], eps: float,
        n_head: int, dtype: torch.dtype,
    ):  # fmt: skip
        if dtype not in (torch.float32, torch.bfloat16) or len(products) != 4 or len(norms) != 2:
            raise ValueError(f"block_rows: 4 products, 2 norms and float32 or bf16 activations, got {dtype}")
        d = norms[0][0].numel()
        if d % 8:
            raise ValueError(f"block_rows: widths that are multiples of 8, got {d}")
        widths = (d, d, d, 4 * d)  # the products' inputs
        linears, self.tensors = [], []
        for (kind, weights, bias, n), k in zip(products, widths, strict=True):
            PRODUCTS[kind].check(k, weights, n, f"[M, {k}]")
            wanted = torch.bfloat16 if kind in ("w4a8", "w8a8", "int8", "int4") else weights[0].dtype
            if dtype is not wanted:
                raise ValueError(f"block_rows: {kind} products with {dtype} activations")
            pointers = [w.data_ptr() for w in weights] + [None] * (2 - len(weights))  # weights, scales
            linears.append(_Linear(list(PRODUCTS).index(kind), k, n, *pointers, self._dense(bias, n, dtype)))
            self.tensors += [*weights, bias]
        norm_pointers = []
        for weight, bias in norms:
            norm_pointers += [self._dense(weight, d, dtype), self._dense(bias, d, dtype)]
            self.tensors += [weight, bias]
        self.dtype = dtype
        self.n_head = n_head
        self.struct = _BlockWeights(*linears, *norm_pointers, eps, n_head, d // n_head)

    @staticmethod
    def _dense(tensor: torch.Tensor | None, n: int, dtype: torch.dtype) -> int | None:
        if tensor is None:
            return None
        if tensor.dtype is not dtype or not tensor.is_contiguous() or tensor.numel() != n:
            raise ValueError(
                f"block_rows: norms and biases dense {dtype} [{n}], got {tensor.dtype} {list(tensor.shape)}"
            )
        return tensor.data_ptr()


def block_rows(
    weights: BlockWeights, x: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
    positions: list[int], overwrite: list[bool] | None = None,
) -> torch.Tensor:  # fmt: skip
    """A pre-LN block in one call (lab/kernels/intmm.c says what it computes): x [B, D], the stream of
    B rows of one token in ``weights.dtype``, each row's attention over its caches at its position (as
    ``attend_rows``; the tokens of one prompt are rows sharing a cache at consecutive positions),
    ``overwrite[b]``: row b hands on attn_out + mlp_out. [B, D]."""
    B, D = x.shape
    if x.dtype is not weights.dtype or not x.is_contiguous():
        raise ValueError(f"block_rows: x dense {weights.dtype} [B, D], got {x.dtype} {list(x.shape)}")
    caches = _caches(
        "block_rows", k_caches, v_caches, positions, weights.n_head, D // weights.n_head, x.dtype
    )
    flags = None if overwrite is None else (ctypes.c_uint8 * B)(*overwrite)
    out = torch.empty(B, D, dtype=x.dtype)
    bf16 = x.dtype is torch.bfloat16
    status = _function("block_rows")(
        ctypes.byref(weights.struct), B, bf16, x.data_ptr(), *caches, flags, out.data_ptr()
    )
    if status == -1:
        raise MemoryError(f"block_rows: no memory for the activations of {B} rows")
    if status != 0:
        raise ValueError(f"block_rows: weights the kernel does not take (status {status})")
    return out


SequenceCache = tuple[torch.Tensor, torch.Tensor]
"""One sequence's cache as ``stack_rows`` and ``step_rows`` read it: ``lab.model.KVCache``'s k and v,
[L, 1, H, T_max, Dh] each."""


def _stack_arguments(
    weights: list[BlockWeights], x: torch.Tensor, sequences: list[SequenceCache], positions: list[int],
    layers: list[int], flags: list[list[bool]] | None,
) -> tuple[ctypes.Array, ...]:  # fmt: skip
    """The C ``stack_rows``' arguments checked, as it reads them, for rows x [B, D], row b of the
    sequence ``sequences[b]`` at ``positions[b]``: the blocks' weights, the positions, each (block,
    row)'s keys' and values' pointers and lengths, and ``flags[j][b]`` per block and row (or None)."""
    B, D = x.shape
    dtype = x.dtype
    count = len(weights)
    if not weights or len(layers) != count or flags is not None and len(flags) != count:
        raise ValueError(f"stack_rows: a block's weights per layer, got {count} and {len(layers)} layers")
    if any(w.dtype is not dtype for w in weights) or not x.is_contiguous():
        raise ValueError(f"stack_rows: x dense {weights[0].dtype} [B, D], got {dtype} {list(x.shape)}")
    n_head = weights[0].n_head
    bases = []
    for keys, values in dict.fromkeys(sequences):  # each sequence checked once: a prompt's rows share one
        shape = (n_head, keys.size(-2), D // n_head)
        for cache in (keys, values):
            if cache.dim() != 5 or cache.size(1) != 1 or cache.shape[2:] != shape or cache.dtype is not dtype:
                expected = f"{dtype} [L, 1, {', '.join(map(str, shape))}]"
                raise ValueError(f"stack_rows: caches {expected}, got {cache.dtype} {list(cache.shape)}")
            if not cache.is_contiguous():
                raise ValueError("stack_rows: caches dense")
        if not all(0 <= i < keys.size(0) for i in layers):
            raise ValueError(f"stack_rows: layers {layers} outside caches of {keys.size(0)}")
    for (keys, values), pos in zip(sequences, positions, strict=True):
        if not 0 <= pos < keys.size(-2):
            raise ValueError(f"stack_rows: position {pos} outside a cache of {keys.size(-2)}")
        layer_bytes = keys.stride(0) * keys.element_size()
        bases.append((keys.data_ptr(), values.data_ptr(), layer_bytes, keys.size(-2)))
    pointers, integers = ctypes.c_void_p * (count * B), ctypes.c_int64 * (count * B)
    k_rows = pointers(*[k + i * layer for i in layers for k, _, layer, _ in bases])
    v_rows = pointers(*[v + i * layer for i in layers for _, v, layer, _ in bases])
    lengths = integers(*[t_max for _ in layers for *_, t_max in bases])
    per_row = None if flags is None else _block_flags(flags)
    blocks = (ctypes.c_void_p * count)(*[ctypes.addressof(w.struct) for w in weights])
    return blocks, (ctypes.c_int64 * B)(*positions), k_rows, v_rows, lengths, per_row


def _block_flags(flags: list[list[bool]]) -> ctypes.Array:
    """Flags per block and row, [count][B], as C reads them: [count * B] bytes."""
    values = [flag for block in flags for flag in block]
    return (ctypes.c_uint8 * len(values))(*values)


def _stack_call(
    name: str, weights: list[BlockWeights], x: torch.Tensor, sequences: list[SequenceCache],
    positions: list[int], layers: list[int], overwrite: list[list[bool]] | None, *more,
) -> torch.Tensor:  # fmt: skip
    """The C ``stack_rows`` or ``step_rows`` (``name``) over rows x [B, D], its arguments checked
    (``_stack_arguments``), ``more`` after the flags. [B, D]."""
    B, D = x.shape
    arguments = _stack_arguments(weights, x, sequences, positions, layers, overwrite)
    blocks, at, k_rows, v_rows, lengths, flags = arguments
    out = torch.empty(B, D, dtype=x.dtype)
    bf16 = x.dtype is torch.bfloat16
    status = _function(name)(
        blocks, len(weights), B, bf16, x.data_ptr(), k_rows, v_rows, lengths, at, flags, *more, out.data_ptr()
    )  # fmt: skip
    if status == -1:
        raise MemoryError(f"{name}: no memory for the activations of {B} rows")
    if status != 0:
        raise ValueError(f"{name}: weights the kernel does not take (status {status})")
    return out


def stack_rows(
    weights: list[BlockWeights], x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layers: list[int],
    pos: int, overwrite: list[bool] | None = None,
) -> torch.Tensor:  # fmt: skip
    """One sequence's tokens x [T, D] at positions pos .. pos + T - 1 through a run of blocks in one
    call: ``weights[j]`` (a ``BlockWeights``) over layer ``layers[j]`` of the sequence's cache
    ``keys``, ``values`` (a ``SequenceCache``), each token a row attending causally, as ``block_rows`` over
    each block in turn computes; ``overwrite[j]``: block j hands on attn_out + mlp_out. [T, D]: the
    stream leaving the last block."""
    T = x.size(0)
    if not 0 <= pos <= pos + T <= keys.size(-2):
        raise ValueError(f"stack_rows: positions {pos}..{pos + T - 1} outside a cache of {keys.size(-2)}")
    flags = None if overwrite is None else [[flag] * T for flag in overwrite]
    sequence = [(keys, values)] * T
    return _stack_call("stack_rows", weights, x, sequence, list(range(pos, pos + T)), layers, flags)


class _ExitRule(ctypes.Structure):
    """lab/kernels/intmm.c's ``struct exit_rule``."""

    _fields_ = [
        ("ln_weight", ctypes.c_void_p), ("ln_bias", ctypes.c_void_p), ("eps", ctypes.c_double),
        ("probe_weight", ctypes.c_void_p), ("probe_bias", ctypes.c_void_p), ("threshold", ctypes.c_double),
        ("min_blocks", ctypes.c_int64),
    ]  # fmt: skip


class ExitRule:
    """How an adaptive row of ``step_rows`` decides to leave (``lab.decode``'s adaptive exit): the final
    norm's weight and bias (or None) [D] in the activations' dtype and its eps, the exit probe's weight
    [L, D] and bias [L] in float32 (None: the cosine of consecutive reads), the threshold and the
    fewest blocks before a check. It holds the tensors."""

    def __init__(
        self, norm: tuple[torch.Tensor, torch.Tensor | None, float],
        probe: tuple[torch.Tensor, torch.Tensor] | None, threshold: float, min_blocks: int,
        dtype: torch.dtype,
    ):  # fmt: skip
        ln_weight, ln_bias, eps = norm
        d = ln_weight.numel()
        pointers = [BlockWeights._dense(ln_weight, d, dtype), BlockWeights._dense(ln_bias, d, dtype)]
        self.tensors = [ln_weight, ln_bias]
        if probe is None:
            pointers += [None, None]
        else:
            weight, bias = probe
            if weight.dtype is not torch.float32 or bias.dtype is not torch.float32 or weight.size(-1) != d:
                raise ValueError(
                    f"step_rows: a float32 probe [L, {d}], got {weight.dtype} {list(weight.shape)}"
                )
            if not weight.is_contiguous() or not bias.is_contiguous() or bias.numel() != weight.size(0):
                raise ValueError("step_rows: a dense probe, a bias per block")
            pointers += [weight.data_ptr(), bias.data_ptr()]
            self.tensors += [weight, bias]
        self.layers = None if probe is None else probe[0].size(0)
        self.struct = _ExitRule(*pointers[:2], eps, *pointers[2:], threshold, min_blocks)


def step_rows(
    weights: list[BlockWeights], x: torch.Tensor, sequences: list[SequenceCache], positions: list[int],
    layers: list[int], runs: list[list[bool]], overwrite: list[list[bool]] | None = None,
    rules: list[ExitRule | None] | None = None,
) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """A decode step's rows x [B, D], one token each, row b of its own sequence's cache ``sequences[b]``
    at ``positions[b]``, through their blocks in one call: block ``weights[j]`` over layer ``layers[j]``
    runs on the rows b with ``runs[j][b]`` (the others' streams pass it unchanged), ``overwrite[j][b]``:
    row b takes attn_out + mlp_out from it; as ``block_rows`` of each block's rows alone computes them.
    ``rules[b]`` (an ``ExitRule``; None: a row under a fixed set): row b leaves after a block once its
    rule says so, and each later block it runs gets this position's keys and values from its exit
    state (``lab.decode.propagate_kv``). Each row's stream leaving its last block [B, D], and the
    blocks each row ran."""
    B, D = x.shape
    if len(runs) != len(weights) or any(len(block) != B for block in runs):
        raise ValueError(f"step_rows: a flag per block and row, got {len(runs)} blocks for {len(weights)}")
    if rules is not None and len(rules) != B:
        raise ValueError(f"step_rows: a rule (or None) per row, got {len(rules)} for {B} rows")
    for rule in rules or ():
        if rule is not None and rule.layers is not None and not all(0 <= i < rule.layers for i in layers):
            raise ValueError(f"step_rows: layers {layers} outside a probe of {rule.layers}")
    rule_pointers = None
    if rules is not None:
        rule_pointers = (ctypes.c_void_p * B)(
            *[None if r is None else ctypes.addressof(r.struct) for r in rules]
        )
    ran = (ctypes.c_int64 * B)()
    layer_numbers = (ctypes.c_int64 * len(layers))(*layers)
    more = (_block_flags(runs), layer_numbers, rule_pointers, ran)
    out = _stack_call("step_rows", weights, x, sequences, positions, layers, overwrite, *more)
    return out, list(ran)


class _DraftHead(ctypes.Structure):
    """lab/kernels/intmm.c's ``struct draft_head``."""

    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("wte", "wpe", "translator", "translator_bias")],
        ("ln_weight", ctypes.c_void_p), ("ln_bias", ctypes.c_void_p), ("eps", ctypes.c_double),
        ("table", ctypes.c_void_p), ("table_bias", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("d", ctypes.c_int64),
    ]  # fmt: skip


class DraftHead:
    """What ``draft_row`` reads a draft's token out through, float32 and dense: the token and position
    tables wte [V, D] and wpe [T, D]; the translator (None: the logit lens) as its weight [D_in, D_out]
    and bias [D], ``h + h weight + bias``; the final norm's weight, bias (or None) and eps; the draft
    vocabulary's rows of the token table [N, D] and their biases [N]. It holds the tensors."""

    def __init__(
        self, wte: torch.Tensor, wpe: torch.Tensor, translator: tuple[torch.Tensor, torch.Tensor] | None,
        norm: tuple[torch.Tensor, torch.Tensor | None, float], table: torch.Tensor, table_bias: torch.Tensor,
    ):  # fmt: skip
        D = wte.size(1)
        weight, bias = (None, None) if translator is None else translator
        weight = None if weight is None else weight.t().contiguous()  # [D_out, D_in]: f32_mm's layout
        ln_weight, ln_bias, eps = norm
        N = table.size(0)
        shapes = [
            (wte, (wte.size(0), D)), (wpe, (wpe.size(0), D)), (weight, (D, D)), (bias, (D,)),
            (ln_weight, (D,)), (ln_bias, (D,)), (table, (N, D)), (table_bias, (N,)),
        ]  # fmt: skip
        for tensor, shape in shapes:
            if tensor is None:
                continue
            dense = tensor.is_contiguous() and tuple(tensor.shape) == shape
            if tensor.dtype is not torch.float32 or not dense:
                got = f"{tensor.dtype} {list(tensor.shape)}"
                raise ValueError(f"draft_row: dense float32 {list(shape)}, got {got}")
        if D % 8:
            raise ValueError(f"draft_row: widths that are multiples of 8, got {D}")
        self.tensors = [tensor for tensor, _ in shapes]
        self.positions, self.n = wpe.size(0), table.size(0)
        pointers = [None if tensor is None else tensor.data_ptr() for tensor, _ in shapes]
        self.struct = _DraftHead(*pointers[:6], eps, *pointers[6:], self.n, D)


def draft_row(
    weights: list[BlockWeights], head: DraftHead, token: int, pos: int, keys: torch.Tensor,
    values: torch.Tensor, layers: list[int], overwrite: list[bool] | None = None, read: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:  # fmt: skip
    """One greedy draft step of one sequence in one call, float32: ``token`` at ``pos`` through the
    blocks ``weights`` over layers ``layers`` of its cache (as ``stack_rows`` for one token), then,
    where ``read``, through ``head`` (translator, final norm, the draft vocabulary's rows). The stream
    leaving the blocks [D], the logits [N] and the index of the largest (the first of equals); None
    and 0 without ``read``."""
    D = head.struct.d
    if any(w.dtype is not torch.float32 for w in weights) or len(layers) != len(weights) or not weights:
        raise ValueError("draft_row: float32 blocks, one per layer")
    if not 0 <= pos < min(head.positions, keys.size(-2)):
        raise ValueError(f"draft_row: position {pos} outside the tables or the caches")
    x = torch.empty(1, D)  # stands for the embedded token in the caches' check
    flags = None if overwrite is None else [[flag] for flag in overwrite]
    arguments = _stack_arguments(weights, x, [(keys, values)], [pos], layers, flags)
    blocks, _, k_rows, v_rows, lengths, flags = arguments
    stream, logits = torch.empty(D), torch.empty(head.n) if read else None
    index = _function("draft_row")(
        blocks, len(weights), ctypes.byref(head.struct), token, pos, k_rows, v_rows, lengths, flags,
        stream.data_ptr(), None if logits is None else logits.data_ptr(),
    )  # fmt: skip
    if index == -1:
        raise MemoryError("draft_row: no memory for the draft's activations")
    if index < 0:
        raise ValueError(f"draft_row: weights the kernel does not take (status {index})")
    return stream, logits, index


def multiply_add_rate(turns: int = 2_000_000) -> float:
    """Float multiply-adds a second this CPU sustains on torch's threads, in the vector width the
    products use (lab/kernels/intmm.c): the roof that a prompt's float products, bound by their
    arithmetic, are measured against. ``turns`` x 12 x (8 or 16) per thread: about a tenth of a second."""
    return _function("multiply_add_rate")(turns)


def argmax(x: torch.Tensor) -> int:
    """The index of the largest value of x [n] (float32 or bf16, dense, on the CPU), the first of
    equals; the first NaN's where there is one: what ``int(x.argmax())`` answers."""
    if x.dim() != 1 or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"argmax: x dense float32 or bf16 [n], got {x.dtype} {list(x.shape)}")
    return _function("argmax")(x.data_ptr(), x.numel(), x.dtype is torch.bfloat16)


def logsumexp(x: torch.Tensor) -> float:
    """log sum exp of x [n] (float32, dense, on the CPU): what ``float(torch.logsumexp(x, 0))``
    answers, to float32's last bits (NaN where x holds one, the largest value where it is infinite)."""
    if x.dim() != 1 or x.dtype is not torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"logsumexp: x dense float32 [n] on the CPU, got {x.dtype} {list(x.shape)}")
    return _function("logsumexp")(x.data_ptr(), x.numel())
