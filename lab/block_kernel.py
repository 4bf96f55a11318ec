"""A decode step's blocks through lab.intmm's kernels: each block in one C call, or its attention alone.

    model = lab.weights.load_model("gpt2-random", "w4a8")   # on a CPU where lab.intmm builds: has them
    use_block_kernels(model)                               # in place, on any model on the CPU

A decode step multiplies every weight by a row or a few, and around those products a block made some
thirty calls into torch and ctypes (two norms, a GELU, the adds, the attention over each row's cache,
the hook points, the modules' call paths), each costing more than its work at that size: the step's
fixed cost beside the weights' bytes (docs/inference.md has the figures). Two classes take them over,
with the same parameters, state dict and hook points as the modules they replace:

- ``KernelBlock`` is a ``lab.model.Block`` whose rows of one token over their own caches (what
  ``lab.decode.decode_rows`` runs), and a prompt's tokens over its sequence's cache (a row each,
  attending causally), go through the whole block in one call, ``lab.intmm.block_rows``:
  the pre-LN block (GPT-2's) with products lab.intmm computes (float32 and bf16 weights, int8, int4,
  w4a8, w8a8), each intermediate rounded where torch's ops round it. Each row is computed on its own,
  so a row's result is the one it gets alone (batch invariance), and a prompt gets the same whatever
  chunks it is fed in (float weights: chunks the call takes). Float products take it at up to
  ``lab.float_kernels.SHORT_RUN`` rows, or any number under ``lab.rows.rows_alone``, as
  ``lab.float_kernels`` does, and a sequence's tokens up to ``PROMPT_RUN`` (a longer float run keeps
  torch's matrix-matrix products). int4 and int8 where
  torch's kernels compute them (``QuantizedLinear.kernel``), other norms, training, gradients,
  ``torch.compile``, and any step while a module of the block is hooked keep the modules' forward,
  which computes the same up to the last bits of a LayerNorm's and a GELU's arithmetic.
- ``KernelAttention`` is a ``lab.model.CausalSelfAttention`` whose rows over their own caches
  (``CausalSelfAttention.attend_rows``) go to ``lab.intmm.attend_rows``, for the blocks that keep the
  modules' forward: one call writes every row's key and value and attends, each (row, head) summed
  in a fixed order. Prompts (several tokens), the compiled step (``lab.fast``), gradients,
  ``attention="eager"`` models, other devices and dtypes, and any step while the ``scores`` or
  ``pattern`` hook points are hooked keep torch's attention.

Three more take whole runs of blocks: ``run_stack`` (``GPT.run_stack``, set by ``use_block_kernels``)
runs ``GPT.run_blocks`` of one sequence over its cache in one ``lab.intmm.stack_rows`` call where
every block is a ``KernelBlock`` that takes the tokens (drafts, verifications, prompts' chunks);
``run_rows`` (``GPT.run_rows``) a decode step's rows, each under its own block set over its own cache,
in one ``lab.intmm.step_rows`` call (``lab.decode.decode_rows``' step at any batch); and
``DraftKernel`` a speculation draft's whole step (``lab.intmm.draft_row``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from lab import intmm
from lab.blocks import BlockSet
from lab.float_kernels import SHORT_RUN, KernelLinear
from lab.hooks import hooked
from lab.model import GPT, Block, CausalSelfAttention, KVCache, LayerCache
from lab.quantize import QuantizedLinear
from lab.rows import taking_rows_alone

PROMPT_RUN = 128
"""A float sequence's tokens up to this many (a prompt's chunk: the server's are 64; a verification) take
the one call: there a block's thirty-odd ops through torch cost more than its arithmetic in one call.
A longer run keeps the modules (torch's matrix-matrix products and attention), which overtake the
call's row-by-row attention and one-row tiles as the run grows (docs/inference.md)."""


def uses_block_kernels(device: torch.device | str) -> bool:
    """Whether ``lab.weights.load_model`` gives a model on ``device`` these kernels: a CPU where
    lab.intmm builds."""
    return torch.device(device).type == "cpu" and intmm.unavailable() is None


class KernelAttention(CausalSelfAttention):
    """``CausalSelfAttention`` whose one-token rows over their own caches are lab.intmm's (module
    docstring)."""

    def attend_rows(self, qkv: torch.Tensor, caches: list[LayerCache], positions: list[int]) -> torch.Tensor:
        if not self._kernel_takes(qkv, caches):
            return super().attend_rows(qkv, caches, positions)
        k_caches, v_caches = [k for k, _ in caches], [v for _, v in caches]
        y = intmm.attend_rows(qkv[:, 0], k_caches, v_caches, positions, self.n_head)  # [B, D]
        return y[:, None]  # [B, 1, D]

    def _kernel_takes(self, qkv: torch.Tensor, caches: list[LayerCache]) -> bool:
        if qkv.size(1) != 1 or qkv.device.type != "cpu" or qkv.dtype not in (torch.float32, torch.bfloat16):
            return False
        if self.attention == "eager" or self.scores.is_hooked or self.pattern.is_hooked:
            return False
        if torch.is_grad_enabled() and qkv.requires_grad or torch.compiler.is_compiling():
            return False
        return all(k.dtype is qkv.dtype and k.is_contiguous() and v.is_contiguous() for k, v in caches)


def _product(linear: nn.Module) -> intmm.Product | None:
    """``linear`` as a product of ``lab.intmm.block_rows`` (None: one it does not compute)."""
    if type(linear) is QuantizedLinear and linear.kernel is not None:
        return linear.kernel, linear.kernel_weights(), linear._buffers["bias"], linear.out_features
    if type(linear) is KernelLinear and linear.weight.dtype in (torch.float32, torch.bfloat16):
        kind = "f32" if linear.weight.dtype is torch.float32 else "bf16"
        weight = linear.weight.detach().t()  # [Dout, Din], dense: the kernels' layout
        bias = None if linear.bias is None else linear.bias.detach()
        return kind, (weight,), bias, weight.size(0)
    return None


def _held_modules(block: Block) -> tuple[nn.Module, ...]:
    """The modules whose tensors ``lab.intmm.block_rows`` reads, read through the modules' dicts (the
    attribute path costs a share of the call)."""
    attn, mlp = block._modules["attn"]._modules, block._modules["mlp"]._modules
    return (
        attn["c_attn"],
        attn["c_proj"],
        mlp["c_fc"],
        mlp["c_proj"],
        block._modules["ln_1"],
        block._modules["ln_2"],
    )


def _addresses(modules: tuple[nn.Module, ...]) -> list[int]:
    """Where the modules' parameters and buffers lie: a parameter's data swapped (``.to()``) moves."""
    return _tensor_addresses([d for module in modules for d in (module._parameters, module._buffers)])


def _tensor_addresses(dicts: list[dict[str, torch.Tensor | None]]) -> list[int]:
    """Where the tensors of these ``_parameters`` and ``_buffers`` dicts lie (0: None)."""
    return [0 if tensor is None else tensor.data_ptr() for tensors in dicts for tensor in tensors.values()]


def _not_held() -> None:
    return None


class _Weights:
    """A block's ``lab.intmm.BlockWeights`` (None: the block is not one it computes) and what they were
    built from, to notice when that changes: a module replaced (as lab.quantize replaces them), a
    tensor's data swapped or replaced."""

    def __init__(self, block: Block):
        self.modules = _held_modules(block)
        self.addresses = _addresses(self.modules)
        hooks = [(module._forward_hooks, module._forward_pre_hooks) for module in block.modules()]
        self.hook_dicts = tuple(d for pair in hooks for d in pair)  # any non-empty: the modules' forward
        self.weights: intmm.BlockWeights | None = None
        self.floats = False  # float products: one row, rows alone, or a sequence's run (KernelBlock)
        products = [_product(linear) for linear in self.modules[:4]]
        norms = self.modules[4:]
        if None in products or block.norm != "pre" or any(type(norm) is not nn.LayerNorm for norm in norms):
            return
        if any(norm.weight is None for norm in norms) or block.attn.attention == "eager":
            return
        dtype = norms[0].weight.dtype
        pairs = [(norm.weight.detach(), None if norm.bias is None else norm.bias.detach()) for norm in norms]
        try:
            self.weights = intmm.BlockWeights(products, pairs, norms[0].eps, block.attn.n_head, dtype)
        except ValueError:  # dtypes or layouts the kernels do not read: the modules' forward
            return
        self.floats = products[0][0] in ("f32", "bf16")

    def __reduce__(self):
        return _not_held, ()  # a copy or a pickle of the model builds its own (ctypes holds addresses)

    def current(self, block: Block) -> bool:
        modules = _held_modules(block)
        for module, held in zip(modules, self.modules, strict=True):  # a loop, not all(): 12 calls a step
            if module is not held:
                return False
        return _addresses(modules) == self.addresses


class KernelBlock(Block):
    """``Block`` whose one-token rows over their own caches, and a prompt's tokens, run in one call to
    lab.intmm (module docstring)."""

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | list[LayerCache] | None = None,
        pos: int | list[int] | torch.Tensor = 0,
        overwrite: bool | torch.Tensor = False,
    ) -> torch.Tensor:
        B, T, D = x.shape
        if isinstance(cache, list) and T == 1:  # rows of different sequences, one token each
            caches, positions, sequence = cache, pos, False
        elif isinstance(cache, tuple) and isinstance(pos, int) and B == 1 and cache[0].size(0) == 1:
            caches, positions, sequence = [cache] * T, list(range(pos, pos + T)), True  # a row per token
        else:
            return super().forward(x, cache, pos, overwrite)
        weights = self._kernel_weights(x, B * T, sequence)
        if weights is None:
            return super().forward(x, cache, pos, overwrite)
        if isinstance(overwrite, torch.Tensor):
            flags = overwrite.tolist()  # [B] per row
        else:
            flags = [True] * B * T if overwrite else None
        k_caches, v_caches = [k for k, _ in caches], [v for _, v in caches]
        out = intmm.block_rows(weights, x.reshape(B * T, D), k_caches, v_caches, positions, flags)  # [B*T, D]
        return out.view(B, T, D)

    def held(self) -> _Weights:
        """The block's weights as lab.intmm reads them, built again when its modules or tensors changed."""
        held = self.__dict__.get("_held")
        if held is None or not held.current(self):
            held = self.__dict__["_held"] = _Weights(self)  # in __dict__: not a submodule, not state
        return held

    def _kernel_weights(self, x: torch.Tensor, rows: int, sequence: bool) -> intmm.BlockWeights | None:
        """The block's weights for ``lab.intmm.block_rows`` when it takes these ``rows`` (``sequence``:
        one sequence's tokens), else None."""
        if self.training or torch.compiler.is_compiling() or x.device.type != "cpu":
            return None
        if torch.is_grad_enabled() and (x.requires_grad or self.ln_1.weight.requires_grad):
            return None  # the kernels have no backward
        held = self.held()
        if held.weights is None or not _call_takes(x, rows, sequence, held.floats, held.weights.dtype):
            return None
        return None if any(held.hook_dicts) else held.weights


def _call_takes(x: torch.Tensor, rows: int, sequence: bool, floats: bool, dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` (``floats``: float products) take ``rows`` rows like x in one call
    (``sequence``: tokens of one sequence), as far as the call and no block decides it."""
    if x.dtype is not dtype or _global_forward_hooks or _global_forward_pre_hooks:
        return False
    # longer float runs: torch's matrix-matrix products and attention, as lab.float_kernels has them
    return not floats or rows <= (PROMPT_RUN if sequence else SHORT_RUN) or taking_rows_alone()


def _stack_weights(
    model: GPT, layers: list[int], x: torch.Tensor, rows: int, sequence: bool = True
) -> list[intmm.BlockWeights] | None:
    """Each block's weights for one call over ``rows`` rows like x (``sequence``: tokens of one sequence;
    else a decode step's rows, one token of each), where every block of ``layers`` is a ``KernelBlock``
    that takes them (``KernelBlock.forward``'s rule); else None, as for no block at all. A run built
    before is checked at once and reused while nothing it was built from changed (``_Stack``)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    key, reusable = tuple(layers), not torch.is_grad_enabled()  # with gradients: each block's own checks
    stacks = model.__dict__.get("_stacks")
    stack = None if stacks is None or not reusable else stacks.get(key)
    if stack is not None:
        if stack.current(model):
            if stack.training() or not _call_takes(x, rows, sequence, stack.floats, stack.dtype):
                return None
            return None if any(stack.hook_dicts) else stack.weights
        stacks.clear()  # something changed: the other runs' weights are likely stale too, and held alive
    weights = []
    for i in layers:
        block = model.blocks[i]
        held = block._kernel_weights(x, rows, sequence) if type(block) is KernelBlock else None
        if held is None:
            return None
        weights.append(held)
    if weights and reusable:
        model.__dict__.setdefault("_stacks", _Stacks()).keep(key, _Stack(model, key))
    return weights or None


class _Stack:
    """The ``_Weights`` of a run of ``KernelBlock``s (``layers``), checked at once: a decode step asks for
    the same run every step, and the blocks' checks one by one were a visible share of its time.
    ``current`` and the rest of ``_stack_weights``' fast path make ``KernelBlock._kernel_weights``'s
    checks of every block, flattened."""

    def __init__(self, model: GPT, layers: tuple[int, ...]):
        self.layers = layers
        self.blocks = [model.blocks[i] for i in layers]
        helds = [block.__dict__["_held"] for block in self.blocks]
        self.weights = [held.weights for held in helds]
        self.modules = [module for held in helds for module in held.modules]
        # a module's dicts stay while the module does: current() checks the modules, then these
        self.tensor_dicts = [d for module in self.modules for d in (module._parameters, module._buffers)]
        self.addresses = [address for held in helds for address in held.addresses]  # each held just checked
        self.hook_dicts = tuple(d for held in helds for d in held.hook_dicts)
        self.floats = any(held.floats for held in helds)
        self.dtype = self.weights[0].dtype  # every block's: each was checked against the same x

    def current(self, model: GPT) -> bool:
        """Whether the model still has these blocks, each of them a ``KernelBlock`` with the modules and
        tensors its weights were built from (``_Weights.current``)."""
        blocks = model.blocks._modules
        for i, block in zip(self.layers, self.blocks, strict=True):
            if blocks.get(str(i)) is not block or type(block) is not KernelBlock:
                return False
        modules = [module for block in self.blocks for module in _held_modules(block)]
        if any(module is not held for module, held in zip(modules, self.modules, strict=True)):
            return False
        return _tensor_addresses(self.tensor_dicts) == self.addresses

    def training(self) -> bool:
        return any(block.training for block in self.blocks)


class _Stacks(dict):
    """A model's ``_Stack`` per run of blocks (a decode step's, a draft's, a verification's), a few."""

    LIMIT = 8

    def keep(self, key: tuple[int, ...], stack: _Stack) -> None:
        if len(self) >= self.LIMIT:
            self.clear()
        self[key] = stack

    def __reduce__(self):
        return _Stacks, ()


def run_stack(
    model: GPT, x: torch.Tensor, blocks: Iterable[int], cache: KVCache | None, pos: int,
    overwrite: Collection[int],
) -> torch.Tensor | None:  # fmt: skip
    """``GPT.run_blocks`` of one sequence's tokens x [1, T, D] over its cache: every block in one call
    to ``lab.intmm.stack_rows`` where each of them is a ``KernelBlock`` that takes the tokens in one
    call (``KernelBlock.forward``'s rule), else None (the blocks one by one). [1, T, D]."""
    B, T, D = x.shape
    if cache is None or B != 1 or not isinstance(pos, int):
        return None
    if not isinstance(cache.k, torch.Tensor) or cache.k.size(1) != 1:
        return None  # lab.fast's caches hold a tensor per layer; a batch's cache several sequences
    layers = list(blocks)
    weights = _stack_weights(model, layers, x, T)
    if weights is None:
        return None
    flags = [i in overwrite for i in layers] if overwrite else None
    return intmm.stack_rows(weights, x.reshape(T, D), cache.k, cache.v, layers, pos, flags).view(1, T, D)


def run_rows(
    model: GPT, x: torch.Tensor, blocks: list[list[int]], caches: list[KVCache], positions: list[int],
    overwrite: list[Collection[int]], adaptive: list[BlockSet | None] | None = None,
) -> tuple[torch.Tensor, list[int]] | None:  # fmt: skip
    """A decode step's rows x [B, 1, D], row b through ``blocks[b]`` (ascending) over its own sequence's
    cache ``caches[b]`` at ``positions[b]``, ``overwrite[b]`` its blocks that overwrite: every block any
    row runs in one call to ``lab.intmm.step_rows``, each on the rows that run it (what
    ``lab.decode.decode_rows`` computes block by block, as ``KernelBlock.forward`` computes each
    block's rows), where each of those blocks is a ``KernelBlock`` that takes the B rows in one call.
    ``adaptive[b]``: row b's adaptive block set (None: a fixed one), whose exit check (the final norm
    and the exit probe or the cosine, ``exit_rule``) the call makes after each block, propagating the
    keys and values of the blocks it leaves unrun. The rows' streams [B, 1, D] and the blocks each ran;
    None where the call cannot take them (the blocks one by one)."""
    B, _, D = x.shape
    for cache, row_blocks in zip(caches, blocks, strict=True):
        if not isinstance(cache.k, torch.Tensor) or cache.k.size(1) != 1:
            return None  # lab.fast's caches hold a tensor per layer; a batch's cache several sequences
        if any(later <= earlier for earlier, later in zip(row_blocks, row_blocks[1:], strict=False)):
            return None
    rules = None
    if adaptive is not None and any(adaptive):
        rules = [
            None if block_set is None else exit_rule(model, block_set, x.dtype) for block_set in adaptive
        ]
        if any(
            rule is None and block_set is not None for rule, block_set in zip(rules, adaptive, strict=True)
        ):
            return None
    layers = sorted(set().union(*blocks))
    weights = _stack_weights(model, layers, x, B, sequence=False)
    if weights is None:
        return None
    runs = [[i in row_blocks for row_blocks in blocks] for i in layers]
    flags = [[i in row_overwrite for row_overwrite in overwrite] for i in layers] if any(overwrite) else None
    sequences = [(cache.k, cache.v) for cache in caches]
    out, ran = intmm.step_rows(weights, x.reshape(B, D), sequences, positions, layers, runs, flags, rules)
    return out.view(B, 1, D), ran


def exit_rule(model: GPT, block_set: BlockSet, dtype: torch.dtype) -> intmm.ExitRule | None:
    """An adaptive set's exit check as ``lab.intmm.step_rows`` makes it (``lab.decode.exit_score`` over
    ``model.ln_f``), for activations of ``dtype``; None where the call cannot make it: a final norm that
    is no LayerNorm with a weight, or one that is hooked (its hooks see every check)."""
    norm = model.ln_f
    if type(norm) is not nn.LayerNorm or norm.weight is None or hooked([norm]):
        return None
    probe = None
    if block_set.adaptive_check == "probe":
        probe = (model.exit_probe.weight.contiguous(), model.exit_probe.bias.contiguous())
    bias = None if norm.bias is None else norm.bias.detach()
    try:
        return intmm.ExitRule(
            (norm.weight.detach(), bias, norm.eps), probe, block_set.adaptive_threshold,
            block_set.adaptive_min_blocks, dtype,
        )  # fmt: skip
    except ValueError:
        return None


class DraftKernel:
    """A greedy draft step of ``lab.speculate`` over a draft vocabulary in one call to
    ``lab.intmm.draft_row``: the token embedded, through the drafting blocks (``run_stack``'s rule),
    the tuned lens's translator of the last of them (full rank), the final LayerNorm and the draft
    vocabulary's rows, on a float32 model on the CPU. What the eager draft computes, up to the last
    bits of the norm's and the products' sums: a draft is a guess, and the verification keeps the
    tokens the full set's."""

    def __init__(self, model: GPT, head: intmm.DraftHead):
        self.head = head
        self.probe = torch.empty(1, 1, model.config.n_embd)  # [1, 1, D]: what the blocks' rule is asked about
        self.hookable = (model.wte, model.wpe, model.drop, model.embed, model.ln_f)

    @classmethod
    def build(cls, model: GPT, lens, exit_block: int | None, table: torch.Tensor, bias: torch.Tensor):
        """The kernel for drafts read out over ``table`` [N, D] and ``bias`` [N] (the draft vocabulary),
        through ``lens``'s translator of ``exit_block`` (None: the logit lens); None where the model,
        the lens or the tables are not what it reads."""
        norm = model.ln_f
        if model.run_stack is None or type(norm) is not nn.LayerNorm:
            return None
        if model.wte.weight.dtype is not torch.float32:
            return None
        if norm.weight is None or model.wte.weight.device.type != "cpu":
            return None
        translator = None
        if exit_block is not None:
            if lens.weight is None:  # a low-rank translator: two products, the eager draft's
                return None
            translator = (lens.weight[exit_block], lens.bias[exit_block])  # [D, D], [D]
        ln_bias = None if norm.bias is None else norm.bias.detach()
        try:
            head = intmm.DraftHead(
                model.wte.weight.detach(), model.wpe.weight.detach(), translator,
                (norm.weight.detach(), ln_bias, norm.eps), table, bias,
            )  # fmt: skip
        except ValueError:
            return None
        return cls(model, head)

    def __call__(
        self, model: GPT, blocks: list[int], cache: KVCache, token: int, pos: int, overwrite: Collection[int],
        read: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:  # fmt: skip
        """The stream leaving ``blocks`` for ``token`` at ``pos`` [1, 1, D] and the draft's logits [N]
        (None without ``read``: a round's last token, fed for the verification), writing the blocks'
        keys and values; None where this step cannot take the call (a hook, training, a block the one
        call does not take, lab.fast's caches)."""
        if model.training or hooked(self.hookable):
            return None
        if not isinstance(cache.k, torch.Tensor) or cache.k.size(1) != 1:
            return None
        weights = _stack_weights(model, blocks, self.probe, 1)
        if weights is None:
            return None
        flags = [i in overwrite for i in blocks] if overwrite else None
        head = self.head
        stream, logits, _ = intmm.draft_row(weights, head, token, pos, cache.k, cache.v, blocks, flags, read)
        return stream.view(1, 1, -1), logits


def prefills_in_one_call(model: GPT, chunk: int) -> bool:
    """Whether ``model``'s prefill chunks of up to ``chunk`` tokens, and its decode steps, go through
    lab.intmm's one call (``use_block_kernels``; PROMPT_RUN), where each output is one thread's sum
    in a fixed order: their bits do not depend on the thread count, where torch's matrix-matrix
    products' do (a float run longer than PROMPT_RUN, a model without the kernels)."""
    return getattr(model, "run_stack", None) is run_stack and chunk <= PROMPT_RUN


def use_block_kernels(model: GPT) -> GPT:
    """Give ``model``'s blocks and their attention the kernels (module docstring), and its runs of
    blocks over one sequence the one call (``run_stack``), in place; returns it."""
    for module in model.modules():
        if type(module) is CausalSelfAttention:
            module.__class__ = KernelAttention  # the same parameters; only the rows' attention differs
        elif type(module) is Block:
            module.__class__ = KernelBlock
    model.run_stack, model.run_rows = run_stack, run_rows
    return model


def without_block_calls(model: GPT) -> GPT:
    """``model``'s blocks back to their modules' forward, their attention keeping the kernel, in place:
    the baseline that ``scripts/bench_decode.py`` times the block in one call against."""
    model.run_stack = model.run_rows = None
    for module in model.modules():
        if type(module) is KernelBlock:
            module.__class__ = Block
    return model
