"""Batch-1 decoding speed on this machine, in one run: ours vs transformers, vs the memory-bandwidth bound.

    python scripts/bench_decode.py                  # GPT-2 small shapes, torch's default threads
    python scripts/bench_decode.py --threads 1 --rounds 7 --json bench.json
    python scripts/bench_decode.py --quality-only   # the builtin models' loss per block set
    python scripts/bench_decode.py --rows-only      # the builtin's steps of 2-8 rows, one call or per block
    python scripts/bench_decode.py --prefill-only   # each dtype's prefill of a 19- and a 64-token prompt
    python scripts/bench_decode.py --sampling-only  # drawing a token: ours against the textbook way
    python scripts/bench_decode.py --device cuda    # on a GPU: eager against CUDA graphs, per block set

Everything is measured in the same process with the same threads, configurations interleaved round by
round (each round times every configuration once; the median over rounds is reported), so a machine
shared with other jobs slows all of them alike. Reports:

- ms/token of greedy decoding after a prompt (prefill excluded) for GPT-2 small shapes (``gpt2-random``):
  ``transformers.GPT2LMHeadModel`` fp32 (same weights, its own KV cache), and ours with fp32, bf16,
  weight-only int8 and int4 weights, and int8 and int4 weights times int8 activations (w8a8, w4a8;
  ``lab.quantize``); fp32, bf16, int8, int4 and w4a8 also with torch's kernels
  (``load_model(kernels=False)``: torch's products for the float and weight-only weights, torch's
  attention for all five), the baseline of lab.intmm's; fp32, bf16, w8a8 and w4a8 also with each
  block through its modules (``lab.block_kernel.without_block_calls``), the baseline of the block in
  one call;
- the bandwidth bound: the weight bytes one token reads / the best read bandwidth measured here on a
  buffer of the same size, read again and again as decoding does (where the last-level cache is about
  as large as the weights, that is the cache's bandwidth more than the memory's);
- ms/token with k of 12 blocks skipped, a linear fit (fixed part + per block), and the saving;
- the builtin model's decode step of 2, 4 and 8 rows (under ``all``, and under mixed block sets), every
  row's blocks in one call against block by block (``builtin_rows``);
- each dtype's prefill of a 19- and a 64-token prompt (``prefills``);
- drawing a sampled token (temperature 1, and top_p 0.9): ``lab.sampling.pick_token`` against the
  textbook way (a sort of the whole vocabulary, ``torch.multinomial``), beside a decode step
  (``sampling_costs``);
- the split of a step: its matrix products alone (every Linear at one row, then the read-out, swept
  in turn as a step runs them) and the rest, and the rate at which the products stream the weights;
- the adaptive-exit check's cost per block, end to end (``adaptive=1.0`` checks after every block and
  never exits) and alone;
- one position's unembedding: lab.intmm's kernel vs mv vs F.linear on the tied [V, D] table vs a
  transposed [D, V] copy;
- on each builtin model (if created: ``builtin``, ``builtin-early-exit``), on held-out standard-library
  files: the loss change of bf16, int8, w8a8, int4 and w4a8, and loss vs mean blocks per token under
  adaptive exit and fixed early exits (``--quality-only``: only these, no timing).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from json import dumps
from pathlib import Path

import torch
import torch.nn.functional as F

from lab import fast, flags, tokens
from lab.block_kernel import without_block_calls
from lab.blocks import BlockSet
from lab.corpora import held_out_stdlib_files
from lab.decode import Decoder, decode_rows, greedy_ms_per_token, stability
from lab.float_kernels import FLOAT_KERNELS, KernelReadOut
from lab.generate import score
from lab.machine import Device, device_named
from lab.measure import interleaved, interval
from lab.model import GPT, Linear
from lab.quantize import QuantizedLinear
from lab.rows import rows_alone
from lab.sampling import SamplingParams, greedy_token, pick_token
from lab.weights import BUILTIN_MODELS, builtin_source, load_model

LOW_PRECISION = ("bfloat16", "int8", "w8a8", "int4", "w4a8")
"""Weights besides fp32 that decoding is measured with (lab.quantize)."""
MODULE_BLOCK_DTYPES = ("float32", "bfloat16", "w8a8", "w4a8")
"""Also timed with each block through its modules (``lab.block_kernel.without_block_calls``): the
baseline of the block in one call."""
TORCH_KERNEL_DTYPES = ("float32", "bfloat16", "int8", "int4", "w4a8")
"""Also timed with torch's kernels (``load_model(kernels=False)``): the baseline of lab.intmm's float
and weight-only products (lab.float_kernels, lab.quantize) and decode steps' blocks in one call each
(lab.block_kernel)."""
SKIPS = (3, 6, 9, 12)
"""Blocks skipped (the last k) in the per-block fit."""


def hf_twin(model: GPT):
    """transformers' GPT2LMHeadModel holding our model's weights (Conv1D is [in, out] like ours)."""
    import transformers

    cfg = model.config
    hf_config = transformers.GPT2Config(
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    state = {"transformer." + k.replace("blocks.", "h."): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return hf


@torch.inference_mode()
def ms_per_token_hf(hf, prompt: list[int], n_tokens: int) -> float:
    device = hf.device
    out = hf(torch.tensor([prompt], device=device), use_cache=True)
    cache_name = "cache" if "cache" in out else "past_key_values"  # renamed in transformers 5.x
    token = int(out.logits[0, -1].argmax())
    start = time.perf_counter()
    for _ in range(n_tokens):
        out = hf(torch.tensor([[token]], device=device), use_cache=True, **{cache_name: out[cache_name]})
        token = int(out.logits[0, -1].argmax())
    return (time.perf_counter() - start) * 1e3 / n_tokens


def read_bandwidth(n_bytes: int, repeats: int = 7) -> float:
    """Best read bandwidth (GB/s) over a fp32 buffer of ``n_bytes`` (the working set of one token), read
    again and again as decoding does: the fastest of a sum, a dot product and a matrix-vector product
    over it, each best of ``repeats``."""
    buffer = torch.ones(n_bytes // 4)  # [N]
    rows = buffer[: buffer.numel() // 768 * 768].view(-1, 768)  # [N / 768, 768]
    ones = torch.ones(768)
    readers = [buffer.sum, lambda: torch.dot(buffer, buffer), lambda: torch.mv(rows, ones)]
    best = min(min(_timed(read) for _ in range(repeats)) for read in readers)
    return n_bytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes_per_token(model: GPT) -> int:
    """Bytes of weights one decode step reads: everything but the position table (one row of it) and,
    when a quantized copy reads out (lab.quantize), the token table (one row of it, the embedding)."""
    one_row = {"wpe.weight"} | ({"wte.weight"} if isinstance(model.read_out, QuantizedLinear) else set())
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for name, t in tensors if name not in one_row)


@torch.inference_mode()
def weights_ms(model: GPT, repeats: int = 7) -> float:
    """ms of one decode step's matrix products alone: every Linear of the blocks at one row, in the
    order a step runs them, then the read-out; best of ``repeats`` sweeps. The step's time minus this
    is what the rest of it costs (norms, attention, additions, Python)."""
    layers = [m for m in model.blocks.modules() if isinstance(m, (Linear, QuantizedLinear))]
    dtype = model.wte.weight.dtype
    widths = [m.in_features if isinstance(m, QuantizedLinear) else m.weight.size(0) for m in layers]
    inputs = [torch.randn(1, 1, width, dtype=dtype) for width in widths]  # [1, 1, Din] each
    read = torch.randn(1, 1, model.config.n_embd, dtype=dtype)  # [1, 1, D]

    def sweep() -> None:
        for layer, x in zip(layers, inputs, strict=True):
            layer(x)
        model.unembed(read)

    sweep()
    return min(_timed(sweep) for _ in range(repeats)) * 1e3


@torch.inference_mode()
def check_cost_alone(model: GPT, repeats: int = 200) -> float:
    """ms of one adaptive-exit check (ln_f, cosine, to Python) on a [1, 1, D] stream."""
    x, before = torch.randn(1, 1, model.config.n_embd), torch.randn(1, 1, model.config.n_embd)
    times = [_timed(lambda: float(stability(model.ln_f(x), before))) for _ in range(repeats)]
    return statistics.median(times) * 1e3


@torch.inference_mode()
def unembed_ms(model: GPT, repeats: int = 20) -> dict[str, float]:
    """ms of one position's unembedding: torch.mv and F.linear on the tied [V, D] table, a product with
    a transposed contiguous [D, V] copy, and lab.intmm's kernel on the table where the model reads out
    through it (lab.float_kernels); "(used)" marks what the read-out does."""
    h = torch.randn(model.config.n_embd, dtype=model.wte.weight.dtype)  # [D]
    table = model.wte.weight  # [V, D]
    table_t = table.t().contiguous()  # [D, V]
    kernels = isinstance(model.read_out, KernelReadOut)
    ways = {
        f"mv [V, D]{'' if kernels else ' (used)'}": lambda: torch.mv(table, h),  # [V]
        "F.linear [V, D]": lambda: F.linear(h[None], table),  # [1, V]
        "h @ [D, V] copy": lambda: h[None] @ table_t,  # [1, V]
    }
    if kernels:  # the read-out's own product (none where lab.intmm does not build)
        ways["lab.intmm [V, D] (used)"] = lambda: FLOAT_KERNELS[table.dtype](h[None], table)  # [1, V]
    return {name: statistics.median(_timed(way) for _ in range(repeats)) * 1e3 for name, way in ways.items()}


def held_out_windows(length: int, count: int = 4) -> list[tuple[str, list[int]]]:
    """``length`` tokens from the middle (code, past the opening docstring) of the first ``count``
    held-out standard-library files (validation files of lab.builtin) that have twice that many."""
    windows = []
    for path in held_out_stdlib_files():
        ids = tokens.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= 2 * length:
            middle = len(ids) // 2
            windows.append((path.name, ids[middle : middle + length]))
        if len(windows) == count:
            return windows
    raise RuntimeError(f"fewer than {count} held-out files have {length} tokens")


def builtin_quality(name: str = "builtin") -> dict | None:
    """On a builtin model (if created), on held-out files: the loss change of bf16, int8, w8a8, int4,
    w4a8 weights, and loss vs mean blocks per token for adaptive-exit thresholds and for fixed early exits."""
    if not (builtin_source(name) / "blocklab.json").exists():
        return None
    fp32 = load_model(name)
    n = fp32.config.n_layer
    windows = held_out_windows(fp32.config.block_size + 1)

    def mean_score(model: GPT, spec: str) -> dict[str, float]:
        results = [score(model, ids, BlockSet.parse(spec, n)) for _, ids in windows]
        return {
            "loss": statistics.mean(r.mean_loss for r in results),
            "mean_blocks": statistics.mean(r.mean_blocks for r in results),
        }

    loss32 = mean_score(fp32, "all")["loss"]
    losses = {dtype: mean_score(load_model(name, dtype), "all")["loss"] for dtype in LOW_PRECISION}
    specs = [f"adaptive={t};min=2" for t in (1.0, 0.999, 0.995, 0.99, 0.98, 0.95)]
    if fp32.exit_probe is not None:
        specs += [f"adaptive={t};min=2;check=probe" for t in (0.95, 0.9, 0.8, 0.7, 0.5)]
    specs += [f"exit={k}" for k in (2, 4, 6, 8, 10)]
    return {
        "texts": [name for name, _ in windows],
        "tokens_each": fp32.config.block_size + 1,
        "loss": {"float32": loss32, **losses},
        "loss_change": {dtype: loss - loss32 for dtype, loss in losses.items()},
        "loss_vs_blocks": {spec: mean_score(fp32, spec) for spec in specs},
    }


def decode_ms(
    models: dict[str, GPT],
    prompt: list[int],
    tokens: int,
    rounds: int,
    compiled: dict[str, GPT],
    torch_kernels: dict[str, GPT],
    module_blocks: dict[str, GPT],
) -> tuple[dict, float]:
    """ms/token of every configuration (transformers fp32, ours in each dtype, ours fp32 with the adaptive
    check after every block and with k blocks skipped, each of ``compiled``: ours in that dtype
    through lab.fast, each of ``torch_kernels``: ours in that dtype without lab.intmm's float
    products and attention, and each of ``module_blocks``: ours with each block through its modules
    rather than in one call), the median over ``rounds`` rounds each timing every configuration once;
    and the largest logit difference between transformers and ours."""
    ours = models["float32"]
    hf = hf_twin(ours)
    with torch.inference_mode():  # same weights, same function
        diff = (hf(torch.tensor([prompt])).logits - ours(torch.tensor([prompt]))).abs().max().item()
    n = ours.config.n_layer
    configs = {"transformers fp32": lambda: ms_per_token_hf(hf, prompt, tokens)}
    for dtype, model in models.items():
        configs[f"ours {dtype}"] = lambda m=model: greedy_ms_per_token(m, BlockSet(), prompt, tokens)
    configs["ours float32 adaptive=1.0"] = lambda: greedy_ms_per_token(
        ours, BlockSet(adaptive_threshold=1.0), prompt, tokens
    )
    for k in SKIPS:
        block_set = BlockSet(skip=frozenset(range(n - k, n)))
        configs[f"ours float32 skip {k}"] = lambda b=block_set: greedy_ms_per_token(ours, b, prompt, tokens)
    for dtype, model in compiled.items():
        configs[f"ours {dtype} compiled"] = lambda m=model: greedy_ms_per_token(m, BlockSet(), prompt, tokens)
    for dtype, model in torch_kernels.items():
        name = f"ours {dtype}, torch's kernels"
        configs[name] = lambda m=model: greedy_ms_per_token(m, BlockSet(), prompt, tokens)
    for dtype, model in module_blocks.items():
        name = f"ours {dtype}, blocks through modules"
        configs[name] = lambda m=model: greedy_ms_per_token(m, BlockSet(), prompt, tokens)
    ms = {name: statistics.median(values) for name, values in interleaved(configs, rounds).items()}
    ms["ours float32 skip 0"] = ms["ours float32"]
    return ms, diff


def builtin_steps(prompt: list[int], tokens: int, rounds: int, compile: bool) -> dict:
    """The builtin model's batch-1 step, ms/token: its read-out dense (every table row, as before
    ``GPT.compact_read_out``) and compact, at full depth and with the second half of the blocks
    skipped, and (``compile``) through lab.fast; per configuration the median over ``rounds`` rounds,
    each timing every configuration once, with the median's 95% bootstrap interval, and its ratio to
    the compact full-depth step."""
    model, dense = load_model("builtin"), load_model("builtin")
    dense.read_rows, dense.read_table = None, None  # the read-out multiplies all 50257 rows again
    n = model.config.n_layer
    half = BlockSet(skip=frozenset(range(n // 2, n)))
    runs = {"dense all": (dense, BlockSet()), "all": (model, BlockSet()), "skip half": (model, half)}
    if compile:
        quick = fast.accelerate(load_model("builtin"))
        runs |= {"compiled all": (quick, BlockSet()), "compiled skip half": (quick, half)}
    configs = {
        name: lambda m=model_, b=block_set: greedy_ms_per_token(m, b, prompt, tokens)
        for name, (model_, block_set) in runs.items()
    }
    times = interleaved(configs, rounds)  # the warm-up compiles
    base = statistics.median(times["all"])
    return {
        name: {
            "ms_per_token": statistics.median(values),
            "ci": [round(end, 3) for end in interval(values)],
            "over_all": statistics.median(values) / base,
        }
        for name, values in times.items()
    }


def skip_half(n_layer: int) -> str:
    """The block set that skips the middle half of ``n_layer`` blocks: ``skip=3,4,5,6,7,8`` of 12."""
    return f"skip={','.join(map(str, range(n_layer // 4, n_layer // 4 + n_layer // 2)))}"


PROMPT_LENGTHS = (19, 64)
"""Prompts whose prefill ``prefills`` times: a short one, and the server's chunk."""


def prefills(models: dict[str, GPT], prompt: list[int], rounds: int) -> dict:
    """ms of one prompt's prefill (``Decoder.extend``: the blocks over every position, no read-out)
    per dtype and each of ``PROMPT_LENGTHS``, interleaved: the median over ``rounds`` rounds with its
    95% interval. A prefill is bound by the products' arithmetic, a decode step by the weights' bytes."""
    tokens_of = {n: (prompt * (n // len(prompt) + 1))[:n] for n in PROMPT_LENGTHS}

    def prefill(model: GPT, n: int) -> float:
        decoder = Decoder(model, max_len=n)
        start = time.perf_counter()
        decoder.extend(tokens_of[n])
        return (time.perf_counter() - start) * 1e3

    configs = {
        f"{dtype} {n} tokens": lambda m=model, n=n: prefill(m, n)
        for dtype, model in models.items()
        for n in PROMPT_LENGTHS
    }
    times = interleaved(configs, rounds)
    return {
        name: {"ms": statistics.median(values), "ci": [round(end, 3) for end in interval(values)]}
        for name, values in times.items()
    }


ROW_COUNTS = (2, 4, 8)
"""Rows of the multi-row steps ``builtin_rows`` times (the server's steps with that many clients)."""


def textbook_pick(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    """A token drawn the textbook way, the baseline of ``lab.sampling.pick_token``: the softmax over the
    whole vocabulary, a sort of all of it for ``top_p``, then ``torch.multinomial``."""
    probs = F.softmax(logits / sampling.temperature, dim=-1)  # [V]
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)  # [V] each
        before = sorted_probs.cumsum(-1) - sorted_probs  # [V]
        probs = torch.zeros_like(probs).scatter(
            -1, order, sorted_probs.masked_fill(before >= sampling.top_p, 0)
        )
    return int(torch.multinomial(probs, 1, generator=generator))


def sampling_costs(prompt: list[int], rounds: int) -> dict:
    """ms to draw one token from the logits after ``prompt``: ``lab.sampling.pick_token`` against
    ``textbook_pick`` at temperature 1, alone and with top_p 0.9, beside greedy's argmax and the
    model's batch-1 greedy decode step for scale; for the builtin model (a trained, peaked
    distribution over the tokens it reads out) and gpt2-random int4 (GPT-2's 50,257 tokens, near
    uniform: its nucleus holds most of them). Per model ``draw_costs``."""
    models = {"builtin": load_model("builtin"), "gpt2-random int4": load_model("gpt2-random", "int4")}
    return {name: draw_costs(model, prompt, rounds) for name, model in models.items()}


def draw_costs(model: GPT, prompt: list[int], rounds: int, draws: int = 20) -> dict:
    """``sampling_costs`` of one model: per way to draw, the median over ``rounds`` interleaved rounds
    of ``draws`` draws each, with its 95% interval; and ours over the textbook's per setting."""
    logits = Decoder(model).prefill(prompt).float()  # [V]
    generator = torch.Generator().manual_seed(0)
    settings = {"temperature 1": SamplingParams(temperature=1.0), "top_p 0.9": SamplingParams(1.0, top_p=0.9)}

    def per_draw(draw) -> float:
        start = time.perf_counter()
        for _ in range(draws):
            draw()
        return (time.perf_counter() - start) * 1e3 / draws

    measures = {
        f"{setting} {who}": lambda p=picker, s=sampling: per_draw(lambda: p(logits, s, generator))
        for setting, sampling in settings.items()
        for who, picker in (("ours", pick_token), ("textbook", textbook_pick))
    }
    measures["greedy"] = lambda: per_draw(lambda: greedy_token(logits))
    measures["decode step"] = lambda: greedy_ms_per_token(model, BlockSet(), prompt, 8)
    times = interleaved(measures, rounds)
    row = {
        key: {"ms": statistics.median(v), "ci": [round(e, 4) for e in interval(v)]}
        for key, v in times.items()
    }
    for setting in settings:
        row[f"{setting}: ours / textbook"] = row[f"{setting} ours"]["ms"] / row[f"{setting} textbook"]["ms"]
    return row


def builtin_rows(prompt: list[int], rounds: int) -> dict:
    """The builtin model's decode step of several rows under ``rows_alone`` (the server's default
    steps), every row at its own position over its own cache: all rows under ``all``, and rows taking
    ``all``, half the blocks skipped, an exit at half depth and one block skipped in turn. Each through
    ``GPT.run_rows`` (every row's blocks in one call) and block by block (``run_rows`` off: a call per
    block, what a step of more than one row did before), interleaved: ms per step, the median over
    ``rounds`` rounds with its 95% interval, and their ratio."""
    model = load_model("builtin")
    n = model.config.n_layer
    mixed = ["all", skip_half(n), f"exit={n // 2}", "skip=5"]
    one_call = model.run_rows

    def step(decoders: list[Decoder], run_rows) -> float:
        model.run_rows = run_rows
        start = time.perf_counter()
        with rows_alone():
            decode_rows(model, decoders, [tokens.EOT] * len(decoders))
        elapsed = (time.perf_counter() - start) * 1e3
        for decoder in decoders:  # the same positions every time
            decoder.cache.length -= 1
        return elapsed

    results = {}
    for count in ROW_COUNTS:
        for kind, specs in (("all", ["all"]), ("mixed", mixed)):
            decoders = []
            for b in range(count):
                decoder = Decoder(model, BlockSet.parse(specs[b % len(specs)], n), max_len=len(prompt) + 8)
                decoder.extend(prompt[: len(prompt) - b])
                decoders.append(decoder)
            times = interleaved(
                {
                    "one call": lambda d=decoders: step(d, one_call),
                    "block by block": lambda d=decoders: step(d, None),
                },
                rounds,
            )
            medians = {name: statistics.median(values) for name, values in times.items()}
            results[f"{count} rows, {kind}"] = {
                "one_call_ms": medians["one call"],
                "one_call_ci": [round(end, 3) for end in interval(times["one call"])],
                "block_by_block_ms": medians["block by block"],
                "one_call_over_block_by_block": medians["one call"] / medians["block by block"],
            }
    model.run_rows = one_call
    return results


CUDA_DTYPES = ("float32", "bfloat16")
"""The weights timed on a GPU (the integer kinds run on the CPU)."""


def cuda_results(prompt: list[int], tokens: int, rounds: int) -> dict:
    """On the first CUDA device: ms/token of batch-1 greedy decoding of ``gpt2-random`` in each of
    ``CUDA_DTYPES``, eager and through lab.fast's CUDA graphs (a captured step per block set and
    cache bucket, static cache), under every block-set kind the graphs take (all, skip, keep,
    overwrite, exit) and adaptive exit (which decides on the host, so its steps stay eager), against
    transformers in fp32 on the same weights and device; configurations interleaved, the median over
    ``rounds`` rounds with its 95% interval. Each step ends with its token on the host, so the
    clock stops when the GPU has finished."""
    device = "cuda:0"
    models = {dtype: load_model("gpt2-random", dtype, device=device) for dtype in CUDA_DTYPES}
    graphed = {dtype: fast.accelerate(load_model("gpt2-random", dtype, device=device)) for dtype in models}
    n = models["float32"].config.n_layer
    specs = ["all", skip_half(n), f"keep=0,1,{n - 1}", f"overwrite={n // 2}", f"exit={n // 2}"]
    specs.append("adaptive=0.9")
    hf = hf_twin(models["float32"]).to(device)  # the CUDA tensors copied into its CPU ones, then moved
    configs = {"transformers fp32": lambda: ms_per_token_hf(hf, prompt, tokens)}
    for dtype in CUDA_DTYPES:
        for spec in specs:
            block_set = BlockSet.parse(spec, n)
            for way, model in (("eager", models[dtype]), ("graphs", graphed[dtype])):
                configs[f"{dtype} {way} {spec}"] = lambda m=model, b=block_set: greedy_ms_per_token(
                    m, b, prompt, tokens
                )
    times = interleaved(configs, rounds)  # the warm-up call captures each graph
    ms = {name: statistics.median(values) for name, values in times.items()}
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "ms_per_token": ms,
        "ci": {name: [round(end, 3) for end in interval(values)] for name, values in times.items()},
        "graphs_over_eager": {
            f"{dtype} {spec}": ms[f"{dtype} graphs {spec}"] / ms[f"{dtype} eager {spec}"]
            for dtype in CUDA_DTYPES
            for spec in specs
        },
        "over_transformers_fp32": {
            name: value / ms["transformers fp32"] for name, value in ms.items() if name != "transformers fp32"
        },
    }


def per_block_fit(ms: dict[str, float], n: int) -> dict[str, float]:
    """ms/token = fixed + per_block * blocks run: least squares over the skip measurements."""
    xs = [n - k for k in [0, *SKIPS]]
    ys = [ms[f"ours float32 skip {k}"] for k in [0, *SKIPS]]
    x_mean, y_mean = statistics.mean(xs), statistics.mean(ys)
    per_block = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - x_mean) ** 2 for x in xs
    )
    fixed = y_mean - per_block * x_mean
    return {"fixed_ms": fixed, "per_block_ms": per_block, "block_share": per_block * n / ms["ours float32"]}


def bandwidth_results(models: dict[str, GPT], ms: dict[str, float]) -> dict:
    """Per dtype: the weight bytes a token reads, the read bandwidth here, the bound they give, and the
    split of a step into its matrix products and the rest."""
    weight_bytes = {dtype: weight_bytes_per_token(model) for dtype, model in models.items()}
    bandwidth = {dtype: read_bandwidth(n_bytes) for dtype, n_bytes in weight_bytes.items()}
    bound = {dtype: weight_bytes[dtype] / bandwidth[dtype] / 1e6 for dtype in models}  # ms
    products = {dtype: weights_ms(model) for dtype, model in models.items()}
    return {
        "weight_mb_per_token": {dtype: n_bytes / 1e6 for dtype, n_bytes in weight_bytes.items()},
        "read_bandwidth_gb_s": bandwidth,
        "bound_ms": bound,
        "ratio_to_bound": {dtype: ms[f"ours {dtype}"] / bound[dtype] for dtype in models},
        "step_split_ms": {
            dtype: {
                "matrix_products": products[dtype],
                "rest": ms[f"ours {dtype}"] - products[dtype],
                "products_stream_gb_s": weight_bytes[dtype] / products[dtype] / 1e6,
            }
            for dtype in models
        },
    }


def main(
    threads: int = torch.get_num_threads(),
    tokens: int = 32,
    prompt_tokens: int = 32,
    rounds: int = 5,
    json: str | None = None,
    quality_only: bool = False,
    compile: bool = False,
    builtin_rounds: int = 15,
    rows_only: bool = False,
    prefill_only: bool = False,
    sampling_only: bool = False,
    device: Device = "cpu",
) -> None:
    """Measure, print the results as JSON, and write them to ``json`` if given.

    Args:
        threads: Torch threads (default: torch's).
        tokens: Decoded tokens per measurement.
        prompt_tokens: Tokens of the prompt.
        rounds: Rounds of measurements; the median is reported.
        json: Also write the results here.
        quality_only: Only the builtin models' losses (no timing): seconds.
        compile: Also time each dtype through lab.fast's compiled step (compiling each takes a while).
        builtin_rounds: Rounds of the builtin model's step measurements (dense and compact read-out;
            the multi-row steps take three times as many).
        rows_only: Only the builtin model's multi-row steps (``builtin_rows``): seconds.
        prefill_only: Only each dtype's prefill of a 19- and a 64-token prompt (``prefills``): a minute.
        sampling_only: Only the cost of drawing a token, ours against the textbook's (``sampling_costs``):
            seconds.
        device: cpu (everything above), or cuda (auto: where torch sees one): ``cuda_results`` alone,
            eager against CUDA graphs per dtype and block set, and transformers on the same GPU.
    """
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    prompt = torch.randint(0, 50257, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    if quality_only:
        results = {name: builtin_quality(name) for name in BUILTIN_MODELS}
    elif rows_only:
        results = {"threads": threads, "builtin_rows": builtin_rows(prompt, builtin_rounds * 3)}
    elif prefill_only:
        models = {dtype: load_model("gpt2-random", dtype) for dtype in ("float32", *LOW_PRECISION)}
        results = {
            "threads": threads,
            "load_before": load_before,
            "prefill": prefills(models, prompt, rounds),
        }
    elif sampling_only:
        results = {"threads": threads, "sampling": sampling_costs(prompt, rounds)}
    elif device_named(device) != "cpu":
        results = cuda_results(prompt, tokens, rounds)
    else:
        models = {dtype: load_model("gpt2-random", dtype) for dtype in ("float32", *LOW_PRECISION)}
        ours = models["float32"]
        compiled = (
            {dtype: fast.accelerate(load_model("gpt2-random", dtype)) for dtype in models} if compile else {}
        )
        torch_kernels = {
            dtype: load_model("gpt2-random", dtype, kernels=False) for dtype in TORCH_KERNEL_DTYPES
        }
        module_blocks = {
            dtype: without_block_calls(load_model("gpt2-random", dtype)) for dtype in MODULE_BLOCK_DTYPES
        }
        ms, diff = decode_ms(models, prompt, tokens, rounds, compiled, torch_kernels, module_blocks)
        n = ours.config.n_layer
        results = {
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": threads,
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "hf_vs_ours_max_logit_diff": diff,
            "ms_per_token": ms,
            "ratio_to_hf_fp32": {dtype: ms[f"ours {dtype}"] / ms["transformers fp32"] for dtype in models},
            "compiled_over_eager": {
                dtype: ms[f"ours {dtype} compiled"] / ms[f"ours {dtype}"] for dtype in compiled
            },
            "block_calls_over_modules": {
                dtype: ms[f"ours {dtype}"] / ms[f"ours {dtype}, blocks through modules"]
                for dtype in module_blocks
            },
            "lab_kernels_over_torch_kernels": {
                dtype: ms[f"ours {dtype}"] / ms[f"ours {dtype}, torch's kernels"] for dtype in torch_kernels
            },
            **bandwidth_results(models, ms),
            "fit": per_block_fit(ms, n),
            "adaptive_check_ms": {
                "end_to_end_per_block": (ms["ours float32 adaptive=1.0"] - ms["ours float32"]) / (n - 1),
                "alone": check_cost_alone(ours),
            },
            "builtin_step": builtin_steps(prompt, tokens, builtin_rounds, compile),
            "builtin_rows": builtin_rows(prompt, builtin_rounds * 3),
            "prefill": prefills(models, prompt, rounds),
            "sampling": sampling_costs(prompt, rounds),
            "unembed_ms": {"fp32": unembed_ms(ours), "bf16": unembed_ms(models["bfloat16"])},
            **{name.replace("-", "_"): builtin_quality(name) for name in BUILTIN_MODELS},
        }
    print(dumps(results, indent=2))
    if json:
        Path(json).write_text(dumps(results, indent=2))


if __name__ == "__main__":
    flags.call(main)
