"""The compact read-out (``GPT.compact_read_out``): a table of mostly zero rows is read out by
multiplying only the other rows and filling in the bias, with the dense read-out's logits and tokens."""

import copy

import pytest
import torch

from lab import tokens
from lab.config import GPTConfig
from lab.generate import generate
from lab.model import GPT
from lab.quantize import QUANTIZED_DTYPES, WEIGHT_DTYPES, quantize
from lab.rows import rows_alone
from lab.token_data import widen_vocabulary

SEEN = 300
"""Rows the compact model trained (the rest of GPT-2's 50257 are zero with one fixed bias)."""


@pytest.fixture(scope="module")
def widened() -> tuple[GPT, torch.Tensor]:
    """A model widened as the builtin models are, and the GPT-2 ids of its seen rows."""
    torch.manual_seed(0)
    compact = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=SEEN, block_size=32)).eval()
    with torch.no_grad():
        compact.ln_f.weight.uniform_(0.5, 1.5)
        compact.wte.weight.mul_(20)  # logits far apart enough for greedy tokens to be well defined
    gpt2_ids = torch.randperm(tokens.VOCAB_SIZE)[:SEEN].sort().values
    return widen_vocabulary(compact, gpt2_ids, unseen_logit=-30.0), gpt2_ids


def as_dtype(model: GPT, dtype: str) -> GPT:
    model = copy.deepcopy(model)
    if dtype in QUANTIZED_DTYPES:
        return quantize(model, dtype)
    return model.to(getattr(torch, dtype))


def dense(model: GPT) -> GPT:
    """The same model reading out every row of the table."""
    model = copy.deepcopy(model)
    model.read_rows, model.read_table = None, None
    return model


def test_widened_models_read_out_only_their_rows(widened):
    model, gpt2_ids = widened
    assert torch.equal(model.read_rows, gpt2_ids)
    assert model.read_table.shape == (SEEN, model.config.n_embd)
    assert "read_table" not in model.state_dict()  # a copy of table rows, not a weight of its own
    model = dense(model)
    model.compact_read_out()  # a table without zero rows keeps the dense read-out
    full = GPT(model.config).eval()
    full.compact_read_out()
    assert full.read_rows is None


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_compact_read_out_gives_the_dense_logits(widened, dtype):
    model, gpt2_ids = widened
    compact = as_dtype(model, dtype)
    reference = as_dtype(dense(model), dtype)
    assert compact.read_rows is not None and reference.read_rows is None
    idx = gpt2_ids[torch.randint(0, SEEN, (3, 9))]
    with torch.no_grad():
        for batch in (idx, idx[:1, :1]):  # matrix products, and the one-position matrix-vector one
            for alone in (False, True):
                with rows_alone() if alone else torch.enable_grad():
                    ours, theirs = compact(batch).float(), reference(batch).float()
                tolerance = 1e-5 if dtype == "float32" else 0.0
                torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=0)
                assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_compact_read_out_generates_the_dense_tokens(widened, dtype):
    model, gpt2_ids = widened
    prompt = gpt2_ids[:5].tolist()
    steps = [
        [step.token for step in generate(as_dtype(m, dtype), prompt, 12)]  # greedy
        for m in (model, dense(model))
    ]
    assert steps[0] == steps[1]


def test_training_reads_the_whole_table(widened):
    model = copy.deepcopy(widened[0]).train()
    logits = model(widened[1][None, :4])
    logits.sum().backward()
    assert model.wte.weight.grad.ne(0).any(dim=1).sum() > SEEN  # zero rows get gradients too
