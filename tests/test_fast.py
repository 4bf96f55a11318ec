"""lab.fast: the static-shape decode step equals the eager one for every block-set kind that takes it,
the others fall back and say so, rows stay batch-invariant, and the capture wrapper replays in place.

On a CPU the graph path runs with ``eager_capture`` (the wrapper's logic without a GPU); the inductor
path is slow to compile and runs under ``slow``; the CUDA graphs themselves under ``gpu``.
"""

import gc

import pytest
import torch
from torch import nn

from lab import fast, tokens
from lab.blocks import BlockSet
from lab.decode import Decoder
from lab.generate import generate
from lab.hooks import capture
from lab.sampling import SamplingParams
from tests.tiny import TinyModel, assert_rows_alone, random_lens

pytestmark = pytest.mark.usefixtures("one_thread")

N_LAYER = 4
PROMPT = tokens.encode("The quick brown fox jumps over")
FAST_KINDS = [
    "all",
    "skip=1",
    "keep=0,2",
    "exit=2",
    "overwrite=1",
    "skip=0;exit=3;overwrite=2",
    "exit=2;lens=tuned",
]
EAGER_KINDS = ["adaptive=0.9;min=2", "speculate=2;k=3"]  # under CUDA graphs (speculation compiles on the CPU)
SPECULATING = [
    "speculate=2;k=3",
    "skip=1;speculate=2;k=2;lens=tuned",
    "speculate=1;k=4;overwrite=2",
    "speculate=2;k=3;vocab=4096;lens=tuned",
]


def tiny(device="cpu"):
    return TinyModel(n_layer=N_LAYER, n_embd=64, n_head=4, tuned_lens=True)(device)


def accelerated(device="cpu"):
    if device == "cpu":  # the capture wrapper's logic without a GPU
        return fast.accelerate(tiny(device), "graphs", capture=fast.eager_capture)
    return fast.accelerate(tiny(device))


def logits_of(model, spec: str, steps: int = 5) -> torch.Tensor:
    """The prefill's logits, then those of ``steps`` greedy steps: [steps + 1, V]."""
    decoder = Decoder(model, BlockSet.parse(spec, N_LAYER), max_len=len(PROMPT) + steps + 1)
    out = [decoder.prefill(PROMPT)]
    for _ in range(steps):
        logits, _ = decoder.step(int(out[-1].argmax()))
        out.append(logits)
    return torch.stack(out)


def test_bucket_is_a_power_of_two_up_to_the_context():
    assert [fast.bucket(n, 1024) for n in (1, 64, 65, 200, 1000)] == [64, 64, 128, 256, 1024]
    assert fast.bucket(100, 96) == 96


@pytest.mark.parametrize("spec", FAST_KINDS)
def test_the_fast_step_equals_the_eager_step(spec):
    eager, quick = tiny(), accelerated()
    expected, got = logits_of(eager, spec), logits_of(quick, spec)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert quick.fast.steps and not quick.fast.fallbacks  # it did take the fast step


@pytest.mark.parametrize("spec", EAGER_KINDS)
def test_kinds_that_cannot_take_it_fall_back_and_say_so(spec, caplog):
    eager, quick = tiny(), accelerated()
    block_set = BlockSet.parse(spec, N_LAYER)
    with caplog.at_level("INFO", logger="lab.fast"):
        got = [s.token for s in generate(quick, PROMPT, 6, block_set=block_set)]
    assert got == [s.token for s in generate(eager, PROMPT, 6, block_set=block_set)]
    assert set(quick.fast.fallbacks) == {fast.eager_reason(block_set, graphs=True)}
    assert "falls back to the eager step" in caplog.text


def traced(model):
    """``model`` with compiled fast steps whose graphs dynamo traces but inductor does not generate
    (the compile path's logic in seconds; test_the_compiled_cpu_step_equals_the_eager_step generates)."""
    fast.accelerate(model, "compile").fast.backend = "eager"
    return model


@pytest.mark.parametrize("spec", SPECULATING)
def test_speculation_drafts_and_verifies_through_compiled_graphs(spec):
    """Self-speculation's rounds take the compiled path: drafts of one position, verifications of a
    round's positions in one graph (one per round length), the full set's greedy tokens as eager."""
    eager, quick = tiny(), traced(tiny())
    block_set = BlockSet.parse(spec, N_LAYER)
    got = [s.token for s in generate(quick, PROMPT, 12, block_set=block_set)]
    assert got == [s.token for s in generate(eager, PROMPT, 12, block_set=block_set)]
    assert got == [s.token for s in generate(eager, PROMPT, 12, block_set=block_set.without_speculation())]
    kinds = {key[0] for key in quick.fast.steps}
    assert {"draft", "feed", "verify"} <= kinds and not quick.fast.fallbacks


def test_each_compiled_graph_checks_only_its_own_guards():
    """Every graph (kind of step, block set, bucket) is compiled from a code object of its own, so
    dynamo keeps one entry on it: a call never runs through the guards of the model's other graphs."""
    quick = traced(tiny())
    for spec in ("all", "skip=1", "exit=2", SPECULATING[0]):
        list(generate(quick, PROMPT, 6, block_set=BlockSet.parse(spec, N_LAYER)))
    codes = [step.compiled._torchdynamo_orig_callable.__code__ for step in quick.fast.steps.values()]
    assert len(codes) >= 6 and len(set(map(id, codes))) == len(codes)
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    assert [len(entries(code)) for code in codes] == [1] * len(codes)


def test_a_compiled_step_follows_the_thread_count_as_the_tuner_changes_it():
    """lab.threads changes torch's thread count with the load, and dynamo guards on it: a warm graph
    that skips its guards must not then fail ("Recompilation triggered with skip_guard_eval_unsafe"),
    but compile once for the new count and go on with the eager step's tokens."""
    quick, eager = traced(tiny()), tiny()
    before = torch.get_num_threads()
    decoder, reference = Decoder(quick, max_len=32), Decoder(eager, max_len=32)
    token = int(decoder.prefill(PROMPT).argmax())
    assert token == int(reference.prefill(PROMPT).argmax())
    try:
        for threads in (2, 1, 2, 1):
            torch.set_num_threads(threads)
            logits, _ = decoder.fast_step(token)
            expected, _ = reference.step(token)
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
            token = int(expected.argmax())
    finally:
        torch.set_num_threads(before)
    assert not quick.fast.fallbacks


def test_warm_up_builds_each_buckets_step_at_each_thread_count_before_any_request():
    """``fast.warm_up`` leaves one warm graph per bucket of the lengths given, warm at every thread
    count given, and torch's thread count as it was; a request of those lengths then compiles nothing."""
    quick = traced(tiny())
    before = torch.get_num_threads()
    assert fast.warm_up(quick, [20, 60, 100], [1, 2], BlockSet.parse("skip=1", N_LAYER)) > 0
    assert torch.get_num_threads() == before
    blocks = (0, 2, 3)
    assert set(quick.fast.steps) == {("step", blocks, frozenset(), None, length) for length in (64, 128)}
    assert all(step.warm_threads == {1, 2} for step in quick.fast.steps.values())
    list(generate(quick, PROMPT, 4, block_set=BlockSet.parse("skip=1", N_LAYER)))
    assert len(quick.fast.steps) == 2
    assert fast.warm_up(quick, [20], [1], BlockSet.parse("adaptive=0.9;min=2", N_LAYER)) == 0  # eager: none


def test_a_new_tuned_lens_is_read_through_by_the_compiled_steps():
    """The graphs skip their guards once warm; a lens attached after they compiled is still the one
    the next exit reads through (its tensors are the graph's inputs), as in the eager step."""
    quick, eager = traced(tiny()), tiny()
    exit_set = BlockSet.parse("exit=2;lens=tuned", N_LAYER)
    list(generate(quick, PROMPT, 4, block_set=exit_set))
    quick.tuned_lens = eager.tuned_lens = random_lens(eager, seed=5, scale=2.0)
    got = [s.token for s in generate(quick, PROMPT, 8, block_set=exit_set)]
    assert got == [s.token for s in generate(eager, PROMPT, 8, block_set=exit_set)]


def test_a_verification_over_a_static_cache_equals_the_eager_pass():
    """The positions of a round (several queries over the static cache, each masked at its own
    position) give the logits the eager pass over the same cache gives, and the same keys and values."""
    quick, eager = traced(tiny()), tiny()
    decoders = [Decoder(m, max_len=64) for m in (quick, eager)]
    for decoder in decoders:
        decoder.prefill(PROMPT)
    start = len(PROMPT)
    x = torch.randn(1, 4, 64)  # [1, T, D]: four positions' streams entering block 2
    got = quick.fast.verify([2, 3], frozenset(), decoders[0].cache, x, start)  # [T, V]
    expected = eager.unembed(eager.run_blocks(x, [2, 3], decoders[1].cache, start))[0]  # [T, V]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for i in (2, 3):
        got_k, want_k = decoders[0].cache.layer(i)[0], decoders[1].cache.layer(i)[0]
        torch.testing.assert_close(got_k[..., : start + 4, :], want_k[..., : start + 4, :])


def test_a_hook_sends_the_step_to_the_eager_path_and_sees_its_tensors():
    quick = accelerated()
    decoder = Decoder(quick, max_len=len(PROMPT) + 2)
    token = int(decoder.prefill(PROMPT).argmax())
    with capture(quick, "blocks.1.resid_post") as seen:
        logits, _ = decoder.step(token)
    assert seen["blocks.1.resid_post"].shape == (1, 1, 64)
    assert any("hook" in reason for reason in quick.fast.fallbacks)
    eager = Decoder(tiny(), max_len=len(PROMPT) + 2)
    eager.prefill(PROMPT)
    torch.testing.assert_close(logits, eager.step(token)[0])


def test_a_global_hook_sends_the_step_to_the_eager_path_and_sees_its_modules():
    quick = accelerated()
    decoder = Decoder(quick, max_len=len(PROMPT) + 2)
    token = int(decoder.prefill(PROMPT).argmax())
    blocks = set(quick.blocks)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, _inputs, _output: seen.append(module) if module in blocks else None
    )
    try:
        logits, _ = decoder.step(token)
    finally:
        handle.remove()
    assert len(seen) == len(blocks)
    assert any("hook" in reason for reason in quick.fast.fallbacks)
    eager = Decoder(tiny(), max_len=len(PROMPT) + 2)
    eager.prefill(PROMPT)
    torch.testing.assert_close(logits, eager.step(token)[0])


def test_sampled_generation_is_the_eager_one():
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=3)
    runs = [[s.token for s in generate(m, PROMPT, 8, sampling)] for m in (tiny(), accelerated())]
    assert runs[0] == runs[1]


def test_under_rows_alone_every_row_is_bit_for_bit_its_logits_alone():
    """Fast rows step alone and the others together: a row's logits never depend on its batch mates."""
    model = accelerated()
    assert_rows_alone(model, ["all", "adaptive=0.5", "exit=3", "skip=1", "all", "adaptive=0.9;min=2"], PROMPT)


def test_the_graphed_step_replays_into_one_output_on_fresh_inputs():
    calls = []

    def doubled(x):
        calls.append(x.clone())
        return x * 2

    step = fast.GraphedStep(doubled, (torch.tensor([1.0]),), capture=fast.eager_capture)
    first = step(torch.tensor([3.0]))
    assert first.tolist() == [6.0]
    second = step(torch.tensor([5.0]))
    assert second is first and second.tolist() == [10.0]  # the static output, written in place
    assert [c.item() for c in calls] == [1.0, 3.0, 5.0]  # captured on the example, then replayed


def test_a_decoders_static_cache_returns_to_the_pool_when_it_is_collected():
    model = accelerated()
    decoder = Decoder(model, max_len=10)
    cache = decoder.cache
    assert cache.max_len == fast.bucket(10, model.config.block_size)
    decoder.prefill(PROMPT)
    del decoder
    gc.collect()
    again = Decoder(model, max_len=20)  # the same bucket: the same buffers, which the graphs hold
    assert again.cache is cache and again.cache.length == 0


def test_a_compiled_decoders_cache_keeps_each_blocks_keys_and_values_apart():
    """Each block's keys and values in a storage of their own, so the compiled step writes them in
    place (a write through a view of one [L, ...] input makes inductor copy all of it every step)."""
    model = fast.accelerate(tiny(), "compile")
    decoder = Decoder(model, max_len=10)
    layers = [*decoder.cache.k, *decoder.cache.v]
    assert len({layer.untyped_storage().data_ptr() for layer in layers}) == 2 * N_LAYER
    assert all(layer.shape == (1, 4, decoder.cache.max_len, 16) for layer in layers)
    decoder.prefill(PROMPT)  # the eager prefill writes into them
    assert all(layer[:, :, : len(PROMPT)].abs().sum() > 0 for layer in layers)
    assert all(layer[:, :, len(PROMPT) :].abs().sum() == 0 for layer in layers)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["all", "exit=2;overwrite=1", "exit=2;lens=tuned"])
def test_the_compiled_cpu_step_equals_the_eager_step(spec, tmp_path, monkeypatch):
    """inductor's C++ for the step (cached on disk under TORCHINDUCTOR_CACHE_DIR)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    quick = fast.accelerate(tiny(), "compile")
    torch.testing.assert_close(logits_of(quick, spec), logits_of(tiny(), spec), atol=1e-5, rtol=1e-5)
    assert quick.fast.steps and any(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.parametrize("spec", FAST_KINDS + EAGER_KINDS)
def test_cuda_graph_steps_equal_the_eager_cuda_steps(spec):
    eager, quick = tiny("cuda"), accelerated("cuda")
    torch.testing.assert_close(logits_of(quick, spec, 8), logits_of(eager, spec, 8), atol=1e-4, rtol=1e-4)
