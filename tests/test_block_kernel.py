"""A decode step's block in one call (lab.block_kernel.KernelBlock, lab.intmm.block_rows): it computes
what the block's modules compute, writes the caches as they do, each row as if alone, under every
block-set kind; the loader gives it to the models whose products lab.intmm computes; hooks, prompts,
gradients, training, torch's int4 products and other norms keep the modules' forward, and a block
whose modules or weights change is read again."""

import copy

import pytest
import torch

from lab import block_kernel, intmm
from lab.block_kernel import KernelBlock
from lab.decode import Decoder, decode_rows
from lab.exit_probe import ExitProbe
from lab.fast import layers_apart
from lab.float_kernels import SHORT_RUN
from lab.hooks import capture
from lab.model import Block, KVCache, Linear
from lab.rows import rows_alone
from lab.weights import load_model, save_model
from tests.tiny import TinyModel, assert_rows_alone, staggered_decoders

pytestmark = pytest.mark.skipif(intmm.unavailable() is not None, reason=str(intmm.unavailable()))

KINDS = ["float32", "bfloat16", "w4a8", "w8a8", "int4", "int8"]
"""The weights whose products lab.intmm computes, so whose blocks run in one call."""
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "w4a8": 2e-2, "w8a8": 2e-2, "int4": 2e-2, "int8": 2e-2}
"""bf16 activations: a LayerNorm's or a GELU's output may round to the neighbouring bf16 value."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    save_model(TinyModel(n_layer=3, n_embd=64, n_head=4)("cpu"), directory)  # w4a8: widths of 64
    return str(directory)


@pytest.fixture
def block_calls(monkeypatch):
    """A 1 for each block lab.intmm ran in one call: alone (``block_rows``) or in a run of blocks
    (``stack_rows``, ``step_rows``)."""
    calls = []
    block, stack, step = intmm.block_rows, intmm.stack_rows, intmm.step_rows
    monkeypatch.setattr(intmm, "block_rows", lambda *args: calls.append(1) or block(*args))
    monkeypatch.setattr(intmm, "stack_rows", lambda *args: calls.extend([1] * len(args[0])) or stack(*args))
    monkeypatch.setattr(intmm, "step_rows", lambda *args: calls.extend([1] * len(args[0])) or step(*args))
    return calls


def caches(dtype: torch.dtype, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A row's random keys and values [1, H, T_max, Dh] each, the same for the same T_max."""
    made = []
    for t in lengths:
        k, v = torch.randn(2, 1, 4, t, 16, generator=torch.Generator().manual_seed(t)).to(dtype)
        made.append((k.clone(), v.clone()))
    return made


@pytest.mark.parametrize("kind", KINDS)
def test_the_block_in_one_call_is_the_blocks_forward_and_rows_are_alone(saved, block_calls, kind):
    """Rows at different positions over caches of different lengths, one of them overwriting: the
    call's stream and the keys and values it writes are the modules' up to rounding; each row's
    result is bit for bit the one it gets alone or among other rows."""
    model = load_model(saved, kind)
    block = model.blocks[1]
    assert type(block) is KernelBlock
    dtype = model.wte.weight.dtype
    x = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    positions, lengths = [0, 7, 12], [4, 8, 20]
    overwrite = torch.tensor([False, True, False])
    ours, theirs = caches(dtype, lengths), caches(dtype, lengths)
    with torch.inference_mode(), rows_alone():
        out = block(x, ours, positions, overwrite=overwrite)
        expected = Block.forward(block, x, theirs, positions, overwrite=overwrite)
        assert len(block_calls) == 1
        tolerance = TOLERANCE[kind]
        torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
        for (k, v), (k_expected, v_expected) in zip(ours, theirs, strict=True):
            torch.testing.assert_close(k.float(), k_expected.float(), rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(v.float(), v_expected.float(), rtol=tolerance, atol=tolerance)
        for rows in ([0], [2], [1, 2], [2, 0]):
            alone = block(x[rows], caches(dtype, [lengths[b] for b in rows]), [positions[b] for b in rows],
                          overwrite=overwrite[rows])  # fmt: skip
            assert torch.equal(alone, out[rows]), rows
        plain = block(x[:1], caches(dtype, lengths[:1]), positions[:1], overwrite=True)
        expected = Block.forward(block, x[:1], caches(dtype, lengths[:1]), positions[:1], overwrite=True)
        torch.testing.assert_close(plain.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kind", ["float32", "w4a8"])
def test_decoding_through_it_matches_the_modules_under_every_block_set(saved, block_calls, kind):
    """A model whose blocks run in one call decodes rows under different block sets to the logits
    of the same model through its modules, up to rounding; under rows_alone each row is alone."""
    model = load_model(saved, kind)
    specs = ["all", "skip=1", "exit=2", "overwrite=0", "adaptive=0.5", "keep=0,2"]
    fast, _ = assert_rows_alone(model, specs, list(range(30, 40)))
    assert block_calls
    for block in model.blocks:
        block.__class__ = Block
    calls = len(block_calls)
    slow, _ = assert_rows_alone(model, specs, list(range(30, 40)))
    assert len(block_calls) == calls
    tolerance = 1e-4 if kind == "float32" else 5e-2
    torch.testing.assert_close(fast.float(), slow.float(), rtol=tolerance, atol=tolerance)


def test_many_float_rows_share_torchs_product_unless_rows_alone(saved, block_calls):
    """Float products take up to SHORT_RUN rows, or any number alone, as lab.float_kernels has them;
    more rows sharing torch's matrix-matrix product keep the modules; w4a8's take any number."""
    many = SHORT_RUN + 1
    for kind, rows, expected in (("float32", 2, 1), ("float32", many, 0), ("w4a8", many, 1)):
        block_calls.clear()
        model = load_model(saved, kind)
        dtype = model.wte.weight.dtype
        x, rows_caches = torch.zeros(rows, 1, 64, dtype=dtype), caches(dtype, [4] * rows)
        positions = [0] * rows
        with torch.inference_mode():
            model.blocks[0](x, rows_caches, positions)
            assert len(block_calls) == expected, (kind, rows)
            with rows_alone():
                model.blocks[0](x, rows_caches, positions)
        assert len(block_calls) == expected + 1, (kind, rows)


def test_a_float_step_of_a_few_rows_computes_what_each_row_computes_alone(saved, block_calls):
    """Without rows_alone, a float32 step of a few rows (under SHORT_RUN) takes the one call, each
    row bit for bit what it gets under rows_alone; past SHORT_RUN the modules' shared products."""
    model = load_model(saved, "float32")
    specs, prompt, fed = ["all", "skip=1", "exit=2"], list(range(30, 40)), [7, 8, 9]
    with torch.inference_mode():
        decoders = staggered_decoders(model, specs, prompt)
        block_calls.clear()  # the prefills'
        shared, shared_blocks = decode_rows(model, decoders, fed)
        assert len(block_calls) == model.config.n_layer  # each block once, for the rows that run it
        with rows_alone():
            alone, alone_blocks = decode_rows(model, staggered_decoders(model, specs, prompt), fed)
    assert torch.equal(shared, alone) and shared_blocks == alone_blocks


def test_hooks_prompts_gradients_and_training_keep_the_modules(saved, block_calls, monkeypatch):
    """A block with any module hooked (a hook point, a norm, through lab.hooks or torch's own
    hooks, a global hook) runs its modules, so the hooks see what they always saw; the other blocks
    keep the call. So do a float prompt longer than ``PROMPT_RUN``, anything that needs gradients
    and training mode."""
    monkeypatch.setattr(block_kernel, "PROMPT_RUN", 8)  # the tiny model's context is shorter than 128
    model = load_model(saved, "float32")
    L = model.config.n_layer
    decoder = Decoder(model, None, max_len=40)
    decoder.prefill(list(range(1, 10)))  # longer than PROMPT_RUN: torch's products
    assert block_calls == []
    decoder.step(5)
    assert len(block_calls) == L
    decoder.extend([1, 2, 3])  # a short run of the sequence (a speculation round's verification)
    assert len(block_calls) == 2 * L
    block_calls[L:] = []
    with capture(model, ["blocks.1.resid_mid", "blocks.2.mlp.hidden"]) as seen:
        decoder.step(6)
    assert seen["blocks.1.resid_mid"].shape == (1, 1, 64) and len(block_calls) == 2 * L - 2
    handle = model.blocks[0].ln_1.register_forward_hook(lambda *args: None)
    decoder.step(7)
    handle.remove()
    assert len(block_calls) == 3 * L - 3
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    decoder.step(8)
    handle.remove()
    assert len(block_calls) == 3 * L - 3
    decoder.step(9)
    assert len(block_calls) == 4 * L - 3
    block = model.blocks[0]
    x = torch.randn(1, 1, 64, requires_grad=True)
    block(x, caches(torch.float32, [8]), [0]).sum().backward()
    assert x.grad is not None
    block.train()
    with torch.inference_mode():
        block(x.detach(), caches(torch.float32, [8]), [0])
    assert len(block_calls) == 4 * L - 3


def test_what_it_does_not_compute_keeps_the_modules(tmp_path, block_calls):
    """torch's int4 products (widths that are no multiple of 64), a post-LN block and a block whose
    product was replaced by torch's run their modules; the loader's ``kernels=False`` keeps plain
    blocks."""
    save_model(TinyModel(n_layer=2, n_embd=96, n_head=4)("cpu"), tmp_path / "96")
    model = load_model(str(tmp_path / "96"), "int4")
    assert type(model.blocks[0]) is KernelBlock and model.blocks[0].attn.c_attn.kernel is None
    Decoder(model, None, max_len=8).step(3)
    save_model(TinyModel(n_layer=2, n_embd=64, n_head=4)("cpu"), tmp_path)
    assert type(load_model(str(tmp_path), "float32", kernels=False).blocks[0]) is Block
    model = load_model(str(tmp_path), "float32")
    for block in model.blocks:
        block.norm = "post"
    Decoder(model, None, max_len=8).step(3)
    assert block_calls == []
    model = load_model(str(tmp_path), "float32")
    Decoder(model, None, max_len=8).step(3)
    assert len(block_calls) == 2
    replaced = Linear(64, 256)
    replaced.load_state_dict(model.blocks[0].mlp.c_fc.state_dict())
    model.blocks[0].mlp.c_fc = replaced
    Decoder(model, None, max_len=8).step(3)
    assert len(block_calls) == 3


def test_changed_weights_are_read_again_and_copies_work(saved):
    """Weights that change after a step (new data in a parameter, the model in another dtype) are
    the ones the next step reads; a deep copy of the model decodes as the model does."""
    model = load_model(saved, "float32")
    before = Decoder(model, None, max_len=8).step(3)[0]
    copied = copy.deepcopy(model)
    torch.testing.assert_close(Decoder(copied, None, max_len=8).step(3)[0], before, rtol=0, atol=0)
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.c_proj.weight.data = block.mlp.c_proj.weight.data * 2  # a new tensor
    changed = Decoder(model, None, max_len=8).step(3)[0]
    for block in model.blocks:
        block.__class__ = Block
    torch.testing.assert_close(changed, Decoder(model, None, max_len=8).step(3)[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, before)
    model = load_model(saved, "float32").to(torch.bfloat16)
    with torch.inference_mode():
        logits = decode_rows(model, [Decoder(model, None, max_len=8)], [3])[0]
    assert logits.dtype == torch.bfloat16


def test_a_run_of_blocks_reused_across_steps_notices_every_change(saved, block_calls):
    """The step's run of blocks, checked at once and reused from step to step, is read again after each
    change between two steps of one decoder: new data in a parameter, a replaced module, a replaced
    block, a block back to its modules, a hook, training mode, the model in another dtype. Each next
    step gives what a model built with that change gives, runs its blocks in the call exactly when that
    model does, and reuses the run held from the step before only when nothing changed."""
    model = load_model(saved, "float32")
    L = model.config.n_layer
    every_block = tuple(range(L))
    decoder = Decoder(model, None, max_len=24)
    decoder.prefill([1, 2, 3])  # its run of blocks is the steps' too

    def next_step_matches(token: int, calls: int, run: str) -> None:
        block_calls.clear()
        fresh = copy.deepcopy(model)  # built again from the changed model: nothing held
        assert not fresh.__dict__.get("_stacks")
        reference = Decoder(fresh, None, max_len=24)
        reference.cache.k.copy_(decoder.cache.k), reference.cache.v.copy_(decoder.cache.v)
        reference.cache.length = decoder.position
        with torch.inference_mode():
            expected = reference.step(token)[0]
        block_calls.clear()
        held = model.__dict__.get("_stacks", {}).get(every_block)
        with torch.inference_mode():
            logits = decoder.step(token)[0]
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        assert len(block_calls) == calls
        now = model.__dict__["_stacks"].get(every_block)
        seen = {"reused": now is held is not None, "rebuilt": now not in (held, None), "none": now is None}
        assert seen[run]

    next_step_matches(4, L, "reused")
    next_step_matches(5, L, "reused")
    with torch.no_grad():
        model.blocks[1].mlp.c_proj.weight.data = model.blocks[1].mlp.c_proj.weight.data * 3  # a new tensor
    next_step_matches(6, L, "rebuilt")
    replaced = Linear(64, 256)
    replaced.load_state_dict(model.blocks[2].mlp.c_fc.state_dict())
    with torch.no_grad():
        replaced.weight.mul_(-1)
    model.blocks[2].mlp.c_fc = replaced  # a Linear the loader did not give: the block's modules
    next_step_matches(7, L - 1, "none")
    model.blocks[2].mlp.c_fc = type(model.blocks[0].mlp.c_fc)(64, 256)
    model.blocks[2].mlp.c_fc.load_state_dict(replaced.state_dict())
    next_step_matches(8, L, "rebuilt")
    model.blocks[1] = copy.deepcopy(model.blocks[1])
    with torch.no_grad():
        model.blocks[1].ln_2.weight.mul_(0.5)
    next_step_matches(9, L, "rebuilt")
    handle = model.blocks[1].attn.c_proj.register_forward_pre_hook(lambda *args: None)
    next_step_matches(10, L - 1, "reused")  # held, refused while hooked
    handle.remove()
    next_step_matches(11, L, "reused")
    model.blocks[0].__class__ = Block
    next_step_matches(12, L - 1, "none")
    model.blocks[0].__class__ = KernelBlock
    model.blocks[2].train()
    next_step_matches(13, L - 1, "none")
    model.blocks[2].eval()
    next_step_matches(14, L, "rebuilt")
    model.blocks[2].train()
    next_step_matches(15, L - 1, "reused")  # held, refused while training
    model.blocks[2].eval()
    before = decoder.step(16)[0]
    model.to(torch.bfloat16)
    decoder.cache.k, decoder.cache.v = decoder.cache.k.bfloat16(), decoder.cache.v.bfloat16()
    next_step_matches(17, L, "rebuilt")
    assert before.dtype == torch.float32 and decoder.step(18)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_runs_in_one_call_a_row_per_token_and_chunks_change_no_bit(saved, block_calls, kind):
    """A prompt's tokens are rows of one call sharing the sequence's cache, each attending causally
    (float weights too, up to ``PROMPT_RUN`` tokens): the stream is the modules' up to rounding, and
    a prompt fed in chunks gives bit for bit the stream and logits it gives fed at once (each row is
    computed alone)."""
    model = load_model(saved, kind)
    prompt = list(range(40, 57))
    whole = Decoder(model, None, max_len=32)
    stream = whole.extend(prompt)
    assert len(block_calls) == model.config.n_layer
    chunked = Decoder(model, None, max_len=32)
    pieces = [chunked.extend(prompt[:5]), chunked.extend(prompt[5:6]), chunked.extend(prompt[6:])]
    assert torch.equal(torch.cat(pieces), stream)
    assert torch.equal(whole.step(9)[0], chunked.step(9)[0])
    for block in model.blocks:
        block.__class__ = Block
    modules = Decoder(model, None, max_len=32)
    tolerance = TOLERANCE[kind] if kind == "float32" else 5e-2
    torch.testing.assert_close(modules.extend(prompt).float(), stream.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_of_blocks_over_a_sequence_is_one_call_with_the_blocks_bits(saved, monkeypatch, kind):
    """GPT.run_blocks of one sequence's short run (a draft's token, a verification's) is one call to
    lab.intmm.stack_rows, in any order of blocks, overwrite per block: the stream and the keys and
    values each block writes are bit for bit those of the blocks called one by one."""
    model = load_model(saved, kind)
    dtype = model.wte.weight.dtype if kind in ("float32", "bfloat16") else torch.bfloat16
    stacks = []
    stack = intmm.stack_rows
    monkeypatch.setattr(intmm, "stack_rows", lambda *args: stacks.append(len(args[0])) or stack(*args))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 64, generator=generator).to(dtype)  # [1, T, D]
    earlier = torch.randn(2, 3, 1, 4, 16, 16, generator=generator).to(dtype)  # keys, values before pos
    layers, overwrite, pos = [2, 0, 1], {0}, 5
    streams, caches = [], []
    with torch.inference_mode():
        for run_stack in (model.run_stack, None):
            model.run_stack = run_stack
            cache = KVCache(model.config, max_len=16, dtype=dtype)
            cache.k[..., :pos, :], cache.v[..., :pos, :] = earlier[0, ..., :pos, :], earlier[1, ..., :pos, :]
            streams.append(model.run_blocks(x, layers, cache, pos, overwrite))
            caches.append(cache)
    assert stacks == [3]  # one call for the run; none once the model has no run_stack
    assert torch.equal(streams[0], streams[1])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert not torch.equal(caches[0].k[:, 0, :, pos], torch.zeros_like(caches[0].k[:, 0, :, pos]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_decode_steps_rows_under_their_own_block_sets_are_one_call_with_the_blocks_bits(
    saved, monkeypatch, kind
):
    """decode_rows' step of rows under different block sets (skipped, kept, exited, overwriting
    blocks), each at its own position over its own cache, is one call to lab.intmm.step_rows: the
    logits, the blocks run and every cache are bit for bit those of the blocks called one by one, each
    on the rows that run it. An adaptive row in the batch takes the call too (its check: the next
    test)."""
    model = load_model(saved, kind)
    steps = []
    step = intmm.step_rows
    monkeypatch.setattr(intmm, "step_rows", lambda *args: steps.append(len(args[0])) or step(*args))
    specs = ["all", "skip=1", "exit=2", "overwrite=0", "keep=0,2", "exit=1;overwrite=0", "skip=0,1,2"]
    fed = list(range(40, 40 + len(specs)))
    results = []
    with rows_alone():
        for run_rows in (model.run_rows, None):
            model.run_rows = run_rows
            decoders = staggered_decoders(model, specs, list(range(30, 40)))
            logits, blocks_run = decode_rows(model, decoders, fed)
            results.append((logits, blocks_run, [(d.cache.k, d.cache.v, d.position) for d in decoders]))
        mixed = []
        for run_rows in (block_kernel.run_rows, None):
            model.run_rows = run_rows
            decoders = staggered_decoders(model, ["all", "adaptive=0.5", "skip=1"], list(range(30, 40)))
            mixed.append(decode_rows(model, decoders, fed[:3]))
        model.run_rows = block_kernel.run_rows
    assert steps == [3, 3]  # one call a step, the adaptive row's in it; none without run_rows
    assert mixed[0][1] == mixed[1][1]
    (logits, blocks_run, caches), (logits_apart, blocks_apart, caches_apart) = results
    assert torch.equal(logits, logits_apart) and blocks_run == blocks_apart
    assert blocks_run[2] == [0, 1] and blocks_run[6] == []
    for (k, v, at), (k_apart, v_apart, at_apart) in zip(caches, caches_apart, strict=True):
        assert torch.equal(k, k_apart) and torch.equal(v, v_apart) and at == at_apart


@pytest.mark.parametrize("kind", KINDS)
def test_adaptive_rows_decide_and_propagate_inside_the_one_call(saved, block_calls, kind):
    """Adaptive rows (the cosine check and the exit probe, beside fixed rows) take the step's one call:
    the call makes the exit check after each block and writes the keys and values of the blocks a row
    left unrun (CALM's propagation), so over several steps every row runs the blocks the loop's
    check picks, with the loop's logits and caches up to rounding, and no block runs on its own."""
    model = load_model(saved, kind)
    n, D = model.config.n_layer, model.config.n_embd
    generator = torch.Generator().manual_seed(3)
    model.exit_probe = ExitProbe(torch.randn(n, D, generator=generator) * 0.3, torch.zeros(n))
    specs = [
        "all",
        "adaptive=0.9;min=1",
        "adaptive=0.5;min=1;check=probe",
        "skip=1;adaptive=0.99;min=1",
        "exit=2",
    ]
    results = []
    with rows_alone():
        for run_rows in (block_kernel.run_rows, None):
            model.run_rows = run_rows
            decoders = staggered_decoders(model, specs, list(range(30, 40)))
            calls_before = len(block_calls)
            steps = [decode_rows(model, decoders, list(range(50 + 5 * t, 55 + 5 * t))) for t in range(6)]
            results.append(
                (steps, [(d.cache.k, d.cache.v) for d in decoders], len(block_calls) - calls_before)
            )
        model.run_rows = block_kernel.run_rows
    (steps, caches_called, calls), (steps_apart, caches_apart, _) = results
    assert calls == 6 * n  # a call of the n blocks per step, no block on its own
    depths = [len(blocks) for _, blocks_run in steps for blocks in blocks_run[1:4]]
    assert min(depths) < n and max(depths) > 1, "the test wants rows leaving early and rows going on"
    tolerance = TOLERANCE[kind]
    for (logits, blocks_run), (logits_apart, blocks_apart) in zip(steps, steps_apart, strict=True):
        assert blocks_run == blocks_apart
        torch.testing.assert_close(logits.float(), logits_apart.float(), rtol=tolerance, atol=tolerance)
    for (k, v), (k_apart, v_apart) in zip(caches_called, caches_apart, strict=True):
        torch.testing.assert_close(k.float(), k_apart.float(), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(v.float(), v_apart.float(), rtol=tolerance, atol=tolerance)


def test_a_hooked_final_norm_keeps_adaptive_rows_in_the_loop(saved, block_calls):
    """The final norm's hooks see each of an adaptive row's checks: with one on, that row's blocks run
    one by one (the fixed rows still in one call), and the hook fires once per check."""
    model = load_model(saved, "float32")
    seen = []
    handle = model.ln_f.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    try:
        with rows_alone():
            decoders = staggered_decoders(model, ["all", "adaptive=1.0;min=1"], list(range(30, 40)))
            block_calls.clear()
            seen.clear()
            _, blocks_run = decode_rows(model, decoders, [50, 51])
    finally:
        handle.remove()
    n = model.config.n_layer
    assert blocks_run[1] == list(range(n))  # threshold 1.0: every block, a check after each but the last
    assert len(block_calls) == 2 * n  # the fixed row's call, then the adaptive row's blocks one by one
    assert len(seen) == 1 + n  # ln_f before the first check, after each of the n - 1 checks, and the read-out


def test_caches_held_a_tensor_per_layer_run_the_blocks_one_by_one(saved, block_calls, monkeypatch):
    """lab.fast's caches (``layers_apart``: a tensor per layer) are no [L, ...] tensor for the one
    call: the blocks run one by one, each in its own call, computing the same."""
    model = load_model(saved, "float32")
    x = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(4))  # [1, T, D]
    with torch.inference_mode():
        whole = model.run_blocks(x, [0, 1, 2], KVCache(model.config, max_len=8))
        apart = model.run_blocks(x, [0, 1, 2], layers_apart(KVCache(model.config, max_len=8)))
    assert torch.equal(whole, apart) and len(block_calls) == 6
    monkeypatch.setattr(block_kernel, "PROMPT_RUN", 8)
    with torch.inference_mode():  # blocks as an iterator, a prompt longer than PROMPT_RUN: one by one
        prompt = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(5))
        listed = model.run_blocks(prompt, [0, 1, 2], KVCache(model.config, max_len=16))
        iterated = model.run_blocks(prompt, iter([0, 1, 2]), KVCache(model.config, max_len=16))
    assert torch.equal(listed, iterated) and not torch.equal(listed, prompt)
