"""Test helpers of the server's tests: a tiny model that can be made slow or made to fail, the check
that a decode step's rows are each what they are alone, a check of whether a process still lives,
and a valid ``/predict`` answer to fake a server with.

    with ServerProcess(["--max-batch-size", "8"], model_factory=TinyModel()) as server:
        ...
    with ServerProcess(["--threads", "1"], model_factory=TinyModel(fail_token=13)) as server:
        ...  # a request whose prompt holds token 13 raises inside the worker
    model.tuned_lens = random_lens(model)  # lens=tuned exits through random translators
    together, fed = assert_rows_alone(model, ["all", "exit=3"], prompt)  # each row as it is alone

``TinyModel`` is a random ``serve.process.TINY`` GPT. Its ``step_s``, ``slow_token`` and
``fail_token`` make every step or one request slow, or make a request raise inside the worker, to
provoke the faults the server must survive; all are off by default.
"""

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lab import tokens
from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.decode import Decoder, decode_rows
from lab.lens.translator import TunedLens
from lab.model import GPT
from lab.rows import rows_alone
from serve.process import TINY
from serve.schema import PredictResponse


class _InstrumentedGPT(GPT):
    """A GPT whose every pass sleeps, or sleeps or raises when it sees a given token.

    Hooked on ``embed_tokens``, where every pass starts (``forward``, the server's prefill, adaptive exit).
    """

    step_s: float = 0.0
    slow_token: int | None = None
    slow_s: float = 0.0
    fail_token: int | None = None

    def embed_tokens(self, idx: torch.Tensor, pos: int = 0) -> torch.Tensor:
        if self.fail_token is not None and bool((idx == self.fail_token).any()):
            raise RuntimeError(f"injected failure: token {self.fail_token} in the input")
        if self.slow_token is not None and bool((idx == self.slow_token).any()):
            time.sleep(self.slow_s)
        if self.step_s:
            time.sleep(self.step_s)
        return super().embed_tokens(idx, pos)


@dataclass(frozen=True)
class TinyModel:
    """Model factory (``serve.worker.ModelFactory``) of a small random GPT with GPT-2's vocabulary."""

    n_layer: int = TINY.n_layer
    n_embd: int = TINY.n_embd
    n_head: int = TINY.n_head
    block_size: int = TINY.block_size
    seed: int = 0
    step_s: float = 0.0
    """Every pass sleeps this long first: a slower model, so requests stay in flight."""
    slow_token: int | None = None
    """A pass over this token sleeps ``slow_s`` first."""
    slow_s: float = 0.0
    fail_token: int | None = None
    """A pass over this token raises RuntimeError."""
    tuned_lens: bool = False
    """Give it a random tuned lens (``random_lens``), so lens=tuned block sets run."""
    eos_logit: float = 0.0
    """Added to end-of-text's logit (``GPT.logit_bias``): a model that ends its texts at once."""

    def config(self) -> GPTConfig:
        return replace(TINY, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                       block_size=self.block_size, logit_bias=bool(self.eos_logit))  # fmt: skip

    def __call__(self, device: str) -> GPT:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = _InstrumentedGPT(self.config())
        model.step_s, model.slow_token, model.slow_s = self.step_s, self.slow_token, self.slow_s
        model.fail_token = self.fail_token
        if self.eos_logit:
            model.logit_bias[tokens.EOT] = self.eos_logit
        model = model.to(device).eval()
        if self.tuned_lens:
            model.tuned_lens = random_lens(model, self.seed)
        return model


def random_lens(model: GPT, seed: int = 0, scale: float = 0.5) -> TunedLens:
    """A tuned lens of random translators for every block of ``model`` but the last, far enough from
    the identity that lens=tuned exits read out otherwise than the logit lens; in the model's device
    and dtype (attach it after quantizing)."""
    L, D = model.config.n_layer, model.config.n_embd
    generator = torch.Generator().manual_seed(seed)
    lens = TunedLens.identity(L, D)
    lens.weight[: L - 1] = torch.randn(L - 1, D, D, generator=generator) * scale / D**0.5
    lens.bias[: L - 1] = torch.randn(L - 1, D, generator=generator) * scale
    lens.blocks = tuple(range(L - 1))
    lens.ranking = torch.randperm(model.config.vocab_size, generator=generator)  # vocab=N drafts: any N
    return lens.to(model.wte.weight.device, model.wte.weight.dtype)


def staggered_decoders(model: GPT, specs: list[str], prompt: list[int]) -> list[Decoder]:
    """A decoder per block set of ``specs``, the i-th prefilled with ``prompt``'s first 2 + i tokens,
    so that the rows of one step sit at different positions."""
    made = []
    for i, spec in enumerate(specs):
        decoder = Decoder(model, BlockSet.parse(spec, model.config.n_layer), max_len=40)
        decoder.prefill(prompt[: 2 + i])
        made.append(decoder)
    return made


def assert_rows_alone(model: GPT, specs: list[str], prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Under ``rows_alone``, one ``decode_rows`` step of ``staggered_decoders`` gives every row bit
    for bit the logits, and the blocks, it gets stepped alone. The logits together [B, V] and the
    tokens fed."""
    fed = [tokens.encode(" fox")[0] + i for i in range(len(specs))]
    with rows_alone():
        together, blocks_run = decode_rows(model, staggered_decoders(model, specs, prompt), fed)
        for b, decoder in enumerate(staggered_decoders(model, specs, prompt)):
            by_itself, its_blocks = decode_rows(model, [decoder], [fed[b]])
            assert torch.equal(together[b], by_itself[0]), specs[b]
            assert blocks_run[b] == its_blocks[0], specs[b]
    return together, fed


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def predict_response(tokens: int = 2, loss: float | None = 2.5, blocks: float = 3.0, **fields):
    """A ``/predict`` answer as the server would send it: ``tokens`` new tokens, each running ``blocks``
    blocks, and the prompt's mean loss (None: not scored)."""
    score = None if loss is None else {"mean_loss": loss, "token_losses": [loss, loss]}
    return PredictResponse.model_validate({
        "id": None, "text": "ab" * tokens, "tokens": list(range(tokens)), "prompt_tokens": 3,
        "finish_reason": "length", "seed": 1, "block_set": "all", "blocks_run": None,
        "blocks_per_token": [int(blocks)] * tokens, "mean_blocks_per_token": blocks, "score": score,
        "timings": {"queue_ms": 0.1, "prefill_ms": 1.0, "first_token_ms": 1.0, "per_token_ms": 1.0,
                    "total_ms": 3.0},
        "batch_size": 1, **fields,
    })  # fmt: skip
