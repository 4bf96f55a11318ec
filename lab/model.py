"""A GPT-2-architecture decoder in plain torch, read top to bottom: leaves first.

Linear -> HookPoint -> make_norm -> CausalSelfAttention -> MLP -> Block -> KVCache -> GPT.

The residual stream (the "bus") enters each Block as ``resid_pre``; attention adds ``attn_out``
(giving ``resid_mid``) and the feed-forward adds ``mlp_out`` (giving ``resid_post``). Every one of
these is a ``HookPoint`` module, so ``blocks.3.attn_out`` is both a module name and the name of the
tensor ``lab.hooks.capture`` records there. Nothing is copied unless someone captures it.

Shapes: B batch, T positions in this call, S positions attended to (cache included), D width,
H heads, Dh head width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.rows import matmul_rows_alone, taking_rows_alone


class Linear(nn.Module):
    """y = x W + b with W of shape [in, out], as GPT-2's Conv1D (its checkpoints load without a transpose).

    In memory W is laid out [out, in] (W is the transpose of a contiguous [out, in] tensor), and one
    row is multiplied with ``addmv``: at batch 1 every product is a matrix-vector product that streams
    the weight once, and torch's matrix-vector kernel streams an [out, in] matrix at full bandwidth in
    bf16 as well as fp32, where the matrix-matrix kernel reads bf16 at about half the rate (see
    docs/inference.md). Values, shapes and state dicts are those of an [in, out] matrix either way.
    """

    def __init__(self, d_in: int, d_out: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in).t())  # [Din, Dout], rows of Dout contiguous
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *lead, d_in = x.shape
        x2d = x.reshape(-1, d_in)  # [N, Din]
        if x2d.size(0) == 1:  # decoding: one matrix-vector product
            w_out_in = self.weight.t()  # [Dout, Din], contiguous
            if self.bias is None:
                y = torch.mv(w_out_in, x2d[0])  # [Dout]
            else:
                y = torch.addmv(self.bias, w_out_in, x2d[0])  # [Dout]
        elif taking_rows_alone():
            y = matmul_rows_alone(x2d, self.weight, self.bias)  # [N, Dout]
        elif self.bias is None:
            y = x2d @ self.weight  # [N, Dout]
        else:
            y = torch.addmm(self.bias, x2d, self.weight)  # [N, Dout]
        return y.view(*lead, -1)


class HookPoint(nn.Identity):
    """A named place in the forward pass. Returns its input; ``lab.hooks`` records it by name."""

    @property
    def is_hooked(self) -> bool:
        return bool(self._forward_hooks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step passes a hundred hook points; nn.Module's call path through each is a visible
        # share of a small model's step, for hooks that are rarely there.
        hooked = self._forward_hooks or self._forward_pre_hooks
        if hooked or _global_forward_hooks or _global_forward_pre_hooks:
            return super().__call__(x)
        return x


NORM_FIRST = ("pre", "peri")
"""The ``GPTConfig.norm`` variants whose stages read a normalised copy of the stream (the stream itself
is a plain sum of writes, so the model needs a final norm); the others normalise the stream itself."""


def make_norm(cfg: GPTConfig) -> nn.Module:
    """The norm ``cfg.norm_type`` names, over the last dimension D: LayerNorm or RMSNorm."""
    if cfg.norm_type == "rms":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)


LayerCache = tuple[torch.Tensor, torch.Tensor]  # one block's keys and values, [B, H, T_max, Dh] each


def extend_cache(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, pos: int) -> LayerCache:
    """Write keys and values k, v [B, H, T, Dh] at positions pos.. of one block's cache ([B, H, T_max,
    Dh] each); the keys and values of positions 0..pos+T-1, [B, H, S, Dh] each (views)."""
    k_cache, v_cache = cache
    T = k.size(2)
    k_cache[:, :, pos : pos + T] = k
    v_cache[:, :, pos : pos + T] = v
    return k_cache[:, :, : pos + T], v_cache[:, :, : pos + T]


def attend_static(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, pos: torch.Tensor
) -> torch.Tensor:
    """The newest tokens' attention over a static cache: q, k, v [B, H, T, Dh] at positions pos [T], a
    tensor. k and v are written there and every slot of the cache is read, those after each query's
    position masked, so the shapes do not change with the position (``lab.fast`` compiles or captures
    one graph for all): T is 1 for a decode step, a round's drafts plus one for its verification."""
    k_cache, v_cache = cache  # [B, H, T_max, Dh] each
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    allowed = torch.arange(k_cache.size(2), device=q.device)[None] <= pos[:, None]  # [T, T_max]
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=allowed)  # [B, H, T, Dh]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: the only stage that mixes positions."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.attention = cfg.attention
        self.dropout = cfg.dropout
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.qkv = HookPoint()  # [B, T, 3D] the query, key and value projections
        self.scores = HookPoint()  # [B, H, T, S] scaled dot products, masked (-inf above the diagonal)
        self.pattern = HookPoint()  # [B, H, T, S] softmax of the scores
        self.z = HookPoint()  # [B, T, D] the heads' weighted values, concatenated, before c_proj

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | list[LayerCache] | None = None,
        pos: int | list[int] | torch.Tensor = 0,
    ) -> torch.Tensor:
        """``cache`` as a list: one per row ([1, H, T_max, Dh] each), row b at position ``pos[b]`` (rows of
        different sequences decoded together, ``lab.decode.decode_rows``). ``pos`` as a tensor [T]: tokens
        over a static cache (``attend_static``)."""
        B, T, D = x.shape
        qkv = self.qkv(self.c_attn(x))  # [B, T, 3D]
        if isinstance(cache, list):
            y = self.attend_rows(qkv, cache, pos)  # [B, T, D]
        else:
            q, k, v = self._heads(qkv)  # [B, H, T, Dh] each
            if isinstance(pos, torch.Tensor):
                y = attend_static(q, k, v, cache, pos)  # [B, H, T, Dh]
            else:
                if cache is not None:
                    k, v = extend_cache(cache, k, v, pos)  # [B, H, S, Dh], S = pos + T
                y = self._attend(q, k, v)  # [B, H, T, Dh]
            y = y.transpose(1, 2).reshape(B, T, D)  # [B, T, D]
        return self.resid_dropout(self.c_proj(self.z(y)))  # [B, T, D]

    def attend_rows(self, qkv: torch.Tensor, caches: list[LayerCache], positions: list[int]) -> torch.Tensor:
        """Rows of different sequences decoded together (``lab.decode.decode_rows``): row b of qkv
        [B, T, 3D] over its own cache ``caches[b]`` ([1, H, T_max, Dh] each) at ``positions[b]``, the
        same call whatever shares the step: [B, T, D]."""
        B, T, D = qkv.size(0), qkv.size(1), qkv.size(2) // 3
        q, k, v = self._heads(qkv)  # [B, H, T, Dh] each
        rows = [
            self._attend(q[b : b + 1], *extend_cache(caches[b], k[b : b + 1], v[b : b + 1], positions[b]))
            for b in range(B)
        ]
        return torch.cat(rows).transpose(1, 2).reshape(B, T, D)  # [B, T, D]

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, T, 3D] -> the queries, keys and values split into heads, [B, H, T, Dh] each."""
        B, T, D = qkv.size(0), qkv.size(1), qkv.size(2) // 3
        H, Dh = self.n_head, self.head_dim
        q, k, v = qkv.split(D, dim=2)  # 3 x [B, T, D]
        q = q.view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, Dh]
        k = k.view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, Dh]
        v = v.view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, Dh]
        return q, k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, Dh] over k, v [B, H, S, Dh]; query t (position S - T + t) reads keys 0..S - T + t."""
        T, S, Dh = q.size(2), k.size(2), q.size(3)
        dropout = self.dropout if self.training else 0.0
        if self.attention == "eager" or self.scores.is_hooked or self.pattern.is_hooked:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(Dh)  # [B, H, T, S]
            allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)  # [T, S]
            scores = self.scores(scores.masked_fill(~allowed, float("-inf")))
            pattern = self.pattern(F.softmax(scores, dim=-1))  # [B, H, T, S]
            return F.dropout(pattern, dropout, self.training) @ v  # [B, H, T, Dh]
        if T == 1:
            return F.scaled_dot_product_attention(q, k, v)  # [B, H, 1, Dh]: the newest token sees all
        if T == S:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout)


class MLP(nn.Module):
    """The feed-forward stage: per position, D -> 4D -> D with a GELU between."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.hidden = HookPoint()  # [B, T, 4D] after the GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 used the tanh approximation of GELU; checkpoints were trained with it.
        hidden = self.hidden(F.gelu(self.c_fc(x), approximate="tanh"))  # [B, T, 4D]
        return self.dropout(self.c_proj(hidden))  # [B, T, D]


class Block(nn.Module):
    """One stage of the pipeline: attention then feed-forward, each writing into the stream.

    ``cfg.norm`` places the norms (``cfg.norm_type``: LayerNorm or RMSNorm); L blocks:

    pre (GPT-2):        resid_mid = resid_pre + attn(ln_1(resid_pre))
                        resid_post = resid_mid + mlp(ln_2(resid_mid))
    post (GPT-1):       resid_mid = ln_1(resid_pre + attn(resid_pre))
                        resid_post = ln_2(resid_mid + mlp(resid_mid))
    deepnorm (DeepNet): resid_mid = ln_1(alpha * resid_pre + attn(resid_pre)),  alpha = (2L)^(1/4)
                        resid_post = ln_2(alpha * resid_mid + mlp(resid_mid))
                        (and GPT.__init__ scales the init of some weights by beta = (8L)^(-1/4))
    peri (Peri-LN):     resid_mid = resid_pre + ln_1_out(attn(ln_1(resid_pre)))
                        resid_post = resid_mid + ln_2_out(mlp(ln_2(resid_mid)))

    ``attn_out`` and ``mlp_out`` are what each stage adds: for peri, after its output norm.

    ``overwrite=True`` computes both writes as usual but hands on ``attn_out + mlp_out`` alone:
    the incoming stream is dropped, which measures how much later blocks rely on it. A [B] boolean
    tensor chooses per row (rows of different block sets in one pass).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm = cfg.norm
        self.norm_first = cfg.norm in NORM_FIRST  # the stages read ln_1(x), ln_2(x), not the stream
        # DeepNet's residual scale, alpha = (2L)^(1/4) for a decoder-only model of L blocks (Wang et al.
        # 2022, arXiv:2203.00555, Figure 2's table); post-LN is the same formula with alpha = 1.
        self.alpha = (2 * cfg.n_layer) ** 0.25 if cfg.norm == "deepnorm" else 1.0
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        # Peri-LN normalises what each stage writes too; elsewhere these pass it through (no parameters,
        # so GPT-2 checkpoints keep their keys).
        self.ln_1_out = make_norm(cfg) if cfg.norm == "peri" else nn.Identity()
        self.ln_2_out = make_norm(cfg) if cfg.norm == "peri" else nn.Identity()
        self.resid_pre = HookPoint()  # [B, T, D] the stream as it enters
        self.attn_out = HookPoint()  # [B, T, D] what attention adds
        self.resid_mid = HookPoint()  # [B, T, D] the stream between the two stages
        self.mlp_out = HookPoint()  # [B, T, D] what the feed-forward adds
        self.resid_post = HookPoint()  # [B, T, D] the stream as it leaves

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | list[LayerCache] | None = None,
        pos: int | list[int] | torch.Tensor = 0,
        overwrite: bool | torch.Tensor = False,
    ) -> torch.Tensor:
        """``cache`` and ``pos``: see ``CausalSelfAttention.forward``."""
        x = self.resid_pre(x)  # [B, T, D]
        if self.norm_first:  # pre, peri: the stream is the plain sum of what the stages write
            attn_out = self.attn_out(self.ln_1_out(self.attn(self.ln_1(x), cache, pos)))  # [B, T, D]
            mid = self.resid_mid(x + attn_out)
            mlp_out = self.mlp_out(self.ln_2_out(self.mlp(self.ln_2(mid))))  # [B, T, D]
            out = mid + mlp_out
        else:  # post, deepnorm: each sum is normalised
            attn_out = self.attn_out(self.attn(x, cache, pos))  # [B, T, D]
            mid = self.resid_mid(self.ln_1(self.alpha * x + attn_out))
            mlp_out = self.mlp_out(self.mlp(mid))  # [B, T, D]
            out = self.ln_2(self.alpha * mid + mlp_out)
        if isinstance(overwrite, torch.Tensor):
            out = torch.where(overwrite[:, None, None], attn_out + mlp_out, out)  # [B, T, D]
        elif overwrite:
            out = attn_out + mlp_out
        return self.resid_post(out)


class KVCache:
    """Keys and values of every block for the positions seen so far, preallocated to ``max_len``.

    A block that a call skips writes nothing here, so keep one block set for a whole generation
    (adaptive exit fills the skipped blocks' entries itself, see ``lab.generate``).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        batch_size: int = 1,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.max_len = cfg.block_size if max_len is None else max_len
        if not 1 <= self.max_len <= cfg.block_size:
            raise ValueError(f"max_len must be in 1..{cfg.block_size}, got {self.max_len}")
        shape = (cfg.n_layer, batch_size, cfg.n_head, self.max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, H, T_max, Dh]
        self.v = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, H, T_max, Dh]
        self.length = 0  # positions filled so far

    def layer(self, i: int) -> LayerCache:
        return self.k[i], self.v[i]  # [B, H, T_max, Dh] each


class GPT(nn.Module):
    """Token and position tables, a stack of Blocks, a final norm and the tied unembedding.

    post-LN and DeepNorm have no final norm: their last Block ends in ``ln_2``, so the stream leaving
    the stack is already normalised (as in GPT-1), and ``ln_f`` is the identity.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # [V, D], also the unembedding
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)  # [T_max, D]
        self.drop = nn.Dropout(cfg.dropout)
        self.embed = HookPoint()  # [B, T, D] token + position: the stream's first write
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg) if cfg.norm in NORM_FIRST else nn.Identity()
        # what multiplies the table's read rows, where not torch: lab.quantize's copy, lab.float_kernels
        self.read_out: nn.Module | None = None
        self.run_stack: Callable | None = None  # the blocks of one sequence in one call (lab.block_kernel)
        self.run_rows: Callable | None = None  # a decode step's rows through their blocks in one call (idem)
        self.read_rows: torch.Tensor | None = None  # [V_read] rows the read-out multiplies (compact_read_out)
        self.read_table: torch.Tensor | None  # [V_read, D] those rows, contiguous
        self.register_buffer("read_table", None, persistent=False)
        self.read_columns: torch.Tensor | None  # [D, V_read] the same, transposed (float32 only)
        self.register_buffer("read_columns", None, persistent=False)
        self.logit_bias: torch.Tensor | None  # [V], added to every read-out
        self.register_buffer("logit_bias", torch.zeros(cfg.vocab_size) if cfg.logit_bias else None)
        self.exit_probe = None  # lab.exit_probe.ExitProbe: adaptive exit's learned check, fitted per model
        self.tuned_lens = None  # lab.lens.TunedLens: the translators lens=tuned exits read through
        self.fast = None  # lab.fast.FastDecode: compiled or captured decode steps, once lab.fast.accelerate
        self.apply(self._init_weights)
        if cfg.norm == "deepnorm":
            for block in self.blocks:
                self._init_deepnorm(block, beta=(8 * cfg.n_layer) ** -0.25)
            return
        # GPT-2: scale the projections that write into the stream by 1/sqrt(2L), so the stream's
        # variance does not grow with depth at initialisation.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @staticmethod
    def _init_deepnorm(block: Block, beta: float) -> None:
        """DeepNet's init for a decoder-only model of L blocks (Wang et al. 2022, arXiv:2203.00555,
        Figure 2): Xavier normal with gain beta = (8L)^(-1/4) for the feed-forward, value and output
        projections, gain 1 for queries and keys, so the updates' effect on the stream stays bounded."""
        D = block.attn.c_proj.weight.size(0)
        q, k, v = block.attn.c_attn.weight.split(D, dim=1)  # 3 x [D, D], views of [D, 3D]
        nn.init.xavier_normal_(q)
        nn.init.xavier_normal_(k)
        for weight in (v, block.attn.c_proj.weight, block.mlp.c_fc.weight, block.mlp.c_proj.weight):
            nn.init.xavier_normal_(weight, gain=beta)

    def num_params(self, include_position_table: bool = True) -> int:
        """Parameters, counting the tied token table once."""
        n = sum(p.numel() for p in self.parameters())
        return n if include_position_table else n - self.wpe.weight.numel()

    def embed_tokens(self, idx: torch.Tensor, pos: int | torch.Tensor = 0) -> torch.Tensor:
        """The stream's first write: token plus position embeddings. idx [B, T] -> [B, T, D].

        ``pos``: the first position, or [B] one per row (rows of different sequences decoded together).
        """
        B, T = idx.shape
        if isinstance(pos, torch.Tensor):
            end = int(pos.max()) + T
            positions = pos[:, None] + torch.arange(T, device=idx.device)  # [B, T]
        else:
            end = pos + T
            positions = torch.arange(pos, pos + T, device=idx.device)  # [T]
        if end > self.config.block_size:
            raise ValueError(f"{end} positions exceed the context length {self.config.block_size}")
        return self.embed(self.drop(self.wte(idx) + self.wpe(positions)))  # [B, T, D]

    ZERO_ROW_SHARE = 0.1
    """``compact_read_out`` skips a table's zero rows once they are this share of it (fewer save little)."""

    @torch.no_grad()
    def compact_read_out(self) -> None:
        """Have the read-out multiply only the token table's nonzero rows (inference). A zero row's logit
        is its ``logit_bias`` alone (0 without one) whatever the stream, in every precision: ``unembed``
        multiplies the other rows and fills in the bias. The builtin models' tables are mostly such rows.
        The rows are copied (``read_table``, a buffer that follows ``.to()``): call this again after
        changing the table; train mode reads the whole table."""
        table = self.wte.weight  # [V, D]
        nonzero = table.ne(0).any(dim=1)  # [V]
        if float((~nonzero).float().mean()) < self.ZERO_ROW_SHARE:
            self.read_rows, self.read_table, self.read_columns = None, None, None
            return
        self.read_rows = nonzero.nonzero()[:, 0]  # [V_read]
        self.read_table = table[self.read_rows].contiguous()  # [V_read, D]
        # float32, one position: the product down the columns of a [D, V_read] copy is faster than
        # the rows' dot products when rows are short (the builtin's 128), eager and compiled
        float32 = self.read_table.dtype == torch.float32
        self.read_columns = self.read_table.t().contiguous() if float32 else None  # [D, V_read]

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """Read the stream out: final norm, then the tied token table (and ``logit_bias``, if the model
        has one). [B, T, D] -> [B, T, V]."""
        h = self.ln_f(x)  # [B, T, D]
        sparse = self.read_rows is not None and not self.training
        table = self.read_table if sparse else self.wte.weight  # [V_read or V, D]
        columns = self.read_columns if sparse else None  # [D, V_read]: float32 tables only
        if self.read_out is not None:
            logits = self.read_out(h)  # [B, T, V_read or V]
        elif h.numel() == h.size(-1) and columns is not None and columns.dtype == h.dtype == torch.float32:
            logits = (h.reshape(1, -1) @ columns).view(*h.shape[:-1], -1)  # [1, 1, V_read]: down the columns
        elif h.numel() == h.size(-1):  # one position (decoding): a matrix-vector product, as in Linear
            logits = torch.mv(table, h.reshape(-1)).view(*h.shape[:-1], -1)  # [1, 1, V_read or V]
        elif taking_rows_alone():
            rows = matmul_rows_alone(h.reshape(-1, h.size(-1)), table.t(), None)  # [B*T, V_read or V]
            logits = rows.view(*h.shape[:-1], -1)  # [B, T, V_read or V]
        else:
            logits = F.linear(h, table)  # [B, T, V_read or V]
        if not sparse:
            return logits if self.logit_bias is None else logits + self.logit_bias.to(logits.dtype)
        bias = logits.new_zeros(self.config.vocab_size) if self.logit_bias is None else self.logit_bias  # [V]
        read_bias = bias.index_select(0, self.read_rows).to(logits.dtype)  # [V_read]
        full = bias.to(logits.dtype).expand(*logits.shape[:-1], -1).clone()  # [B, T, V]: skipped rows' bias
        # scatter_ along the last dim: index_copy_ there took longer (docs/inference.md)
        return full.scatter_(-1, self.read_rows.expand(*logits.shape[:-1], -1), logits + read_bias)

    def unembed_rows(self, x: torch.Tensor, table: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """The read-out over some tokens only: the final norm, then their rows ``table`` [N, D] of the
        token table and their ``bias`` [N] (``lab.speculate.DraftVocabulary``). One position x [1, 1, D]
        -> [N], a matrix-vector product."""
        return torch.mv(table, self.ln_f(x).reshape(-1)) + bias  # [N]

    def run_blocks(
        self,
        x: torch.Tensor,
        blocks: Iterable[int],
        cache: KVCache | None = None,
        pos: int = 0,
        overwrite: Collection[int] = (),
        keep: Callable[[int], torch.Tensor] | None = None,
        after: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """The stream x [B, T, D] at positions pos.. through ``blocks``, in order: the stack's loop,
        which every pass of one sequence uses (a forward, a prefill, training under layer dropout,
        adaptive exit over a whole text, a draft and its verification).

        Each block writes its keys and values into ``cache`` when one is given. ``keep(i)``: where
        block i's output replaces the stream, a bool mask broadcastable to [B, T, 1]; elsewhere the
        stream passes through unchanged (layer dropout's dropped rows, adaptive exit's exited
        positions). ``after(i, x)`` sees the stream leaving block i (taps, exit checks).
        """
        if self.run_stack is not None and keep is None and after is None:  # lab.block_kernel: in one call
            blocks = list(blocks)  # read again below where the one call does not take them
            out = self.run_stack(self, x, blocks, cache, pos, overwrite)  # [B, T, D], or None
            if out is not None:
                return out
        for i in blocks:
            layer_cache = cache.layer(i) if cache is not None else None
            out = self.blocks[i](x, layer_cache, pos, overwrite=i in overwrite)  # [B, T, D]
            x = out if keep is None else torch.where(keep(i), out, x)  # [B, T, D]
            if after is not None:
                after(i, x)
        return x  # [B, T, D]

    def residual_stream(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        block_set: BlockSet | None = None,
        layer_keep: torch.Tensor | None = None,
        taps: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The stream [B, T, D] leaving the set's blocks for tokens idx [B, T]: forward without the read-out.

        Callers that need only some positions' logits (the last one, when decoding) unembed just those.
        Training (LayerSkip's recipe, ``lab.train``):
        ``layer_keep`` [L, B] says per block which rows run it (the others' streams pass through:
        layer dropout), and ``taps`` receives the stream after each block run, by block index.
        """
        block_set = block_set or BlockSet()
        if block_set.is_adaptive:
            raise ValueError("adaptive exit decides per token: use lab.generate, not GPT.forward")
        pos = cache.length if cache is not None else 0
        if cache is not None and pos + idx.size(1) > cache.max_len:
            raise ValueError(f"{pos + idx.size(1)} positions exceed the cache's {cache.max_len}")
        x = self.embed_tokens(idx, pos)  # [B, T, D]
        x = self.run_blocks(
            x,
            block_set.blocks_to_run(len(self.blocks)),
            cache,
            pos,
            block_set.overwrite,
            keep=None if layer_keep is None else lambda i: layer_keep[i][:, None, None],  # [B, 1, 1]
            after=None if taps is None else taps.__setitem__,
        )  # [B, T, D]
        if cache is not None:
            cache.length = pos + idx.size(1)
        return x  # [B, T, D]

    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        block_set: BlockSet | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] for tokens idx [B, T], continuing ``cache`` when one is given."""
        return self.unembed(self.residual_stream(idx, cache, block_set))  # [B, T, V]
