"""GPT-2-token data for the training lab: source files in, ``(x, y)`` batches in a compact vocabulary out.

    dm = TokenDataModule(stdlib_files())      # lab.corpora: the CPython standard library's own .py source
    dm.vocab_size                             # the distinct tokens that occur (~19k of GPT-2's 50257)
    dm.gpt2_ids                               # [vocab_size] compact id -> GPT-2 id

Why a compact vocabulary: GPT-2's table is 50257 wide, and at a narrow width the unembedding and its
softmax are most of a training step. A corpus uses far fewer distinct tokens (the standard library:
~19k), and every other token is never an input and only ever gets pushed down as an output. So the
model trains on the tokens that occur, and ``widen_vocabulary`` widens the table back to 50257 rows
afterwards, with rows that give every never-seen token the same negligible probability. The tokens
that never occur cost only their rows in the table, not compute in every step.

Files are joined in sorted order, each followed by ``<|endoftext|>``; every ``val_every``-th file
(by that order) is held out for validation, so the split is the same on every machine with the same
files. Batches come from ``lab.data``'s resumable random-window stream.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lab import tokens
from lab.corpora import HELD_OUT_EVERY
from lab.data import DataError, EvenWindows, RandomWindows, StepSampler
from lab.model import GPT
from lab.weights import build_model, widen_state


def encode_files(paths: list[Path]) -> list[list[int]]:
    """GPT-2 tokens of each file (UTF-8, undecodable bytes replaced), each followed by <|endoftext|>."""
    texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in paths]
    return [ids + [tokens.EOT] for ids in tokens.encoding().encode_ordinary_batch(texts, num_threads=2)]


class TokenDataModule(L.LightningDataModule):
    """GPT-2 tokens of source files, split by file, in the compact vocabulary of the tokens that occur.

    Batches are ``(x, y)`` compact ids ``[B, T]``; ``gpt2_ids[x]`` turns them back into GPT-2 ids.
    """

    def __init__(
        self,
        paths: list[str | Path],
        seq_len: int = 256,
        batch_size: int = 16,
        val_every: int = HELD_OUT_EVERY,
        val_batches: int = 4,
        seed: int = 1,
    ):
        """
        Args:
            paths: Text files, joined in the order given.
            seq_len: Tokens per training window (T); at most the model's block_size.
            batch_size: Windows per batch (B).
            val_every: Every val_every-th file (0, val_every, 2*val_every, ...) is validation.
            val_batches: Validation batches, spread evenly over the held-out files.
            seed: Seeds the order of the training windows (a pure function of seed and step).
        """
        super().__init__()
        if seq_len < 1 or batch_size < 1 or val_batches < 1 or val_every < 2:
            raise DataError(
                f"seq_len, batch_size, val_batches must be >= 1 and val_every >= 2: "
                f"{seq_len}, {batch_size}, {val_batches}, {val_every}"
            )
        per_file = encode_files([Path(p) for p in paths])
        val_files = [ids for i, ids in enumerate(per_file) if i % val_every == 0]
        train_files = [ids for i, ids in enumerate(per_file) if i % val_every != 0]
        train = torch.tensor([t for ids in train_files for t in ids], dtype=torch.long)  # [N_train]
        val = torch.tensor([t for ids in val_files for t in ids], dtype=torch.long)  # [N_val]
        for split, part in (("training", train), ("validation", val)):
            if len(part) <= seq_len:
                raise DataError(
                    f"the {split} split has {len(part)} tokens, fewer than one window of seq_len={seq_len} "
                    "plus its target; use more files or a shorter seq_len"
                )
        self.gpt2_ids = torch.unique(torch.cat([train, val]))  # [V_seen] sorted GPT-2 ids that occur
        compact = torch.full((tokens.VOCAB_SIZE,), -1, dtype=torch.long)  # [50257] GPT-2 id -> compact id
        compact[self.gpt2_ids] = torch.arange(len(self.gpt2_ids))
        self.train_ids, self.val_ids = compact[train], compact[val]  # [N] compact ids
        self.n_files, self.n_val_files = len(per_file), len(val_files)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.val_batches = val_batches
        counts = torch.bincount(self.train_ids, minlength=self.vocab_size).double()  # [V]
        p = counts[counts > 0] / counts.sum()
        self.unigram_entropy = float(-(p * p.log()).sum())

    @property
    def vocab_size(self) -> int:
        """The distinct tokens that occur in the files: the compact vocabulary."""
        return len(self.gpt2_ids)

    @property
    def baselines(self) -> dict[str, float]:
        """Reference loss (nats/token) that ``LitGPT`` logs: the best a model ignoring context can do."""
        return {"unigram": self.unigram_entropy}

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        start = trainer.global_step * trainer.accumulate_grad_batches if trainer is not None else 0
        windows = RandomWindows(self.train_ids, self.seq_len, self.batch_size, self.seed)
        return DataLoader(windows, batch_size=None, sampler=StepSampler(start))

    def val_dataloader(self) -> DataLoader:
        windows = EvenWindows(self.val_ids, self.seq_len, self.batch_size, self.val_batches)
        return DataLoader(windows, batch_size=None)


def widen_vocabulary(model: GPT, gpt2_ids: torch.Tensor, unseen_logit: float) -> GPT:
    """The compact-vocabulary model as a GPT-2-vocabulary one (``lab.weights.widen_state``): row
    ``gpt2_ids[i]`` gets compact row i, every never-seen token a zero row and a fixed logit."""
    cfg, state = widen_state(model.config, dict(model.state_dict()), gpt2_ids, unseen_logit)
    return build_model(cfg, state, "builtin (widened)")


@torch.inference_mode()
def lowest_log_normaliser(model: GPT, dm: TokenDataModule) -> float:
    """The smallest logsumexp of the compact model's logits over the validation positions."""
    return min(float(torch.logsumexp(model(x), dim=-1).min()) for x, _ in dm.val_dataloader())


def ngram_baselines(dm: TokenDataModule, smoothing: float = 100.0) -> dict[str, float]:
    """Count models of the training split scored on the validation windows (nats/token): the unigram,
    and the bigram interpolated with it, p(y | x) = (c(x, y) + smoothing * p(y)) / (c(x) + smoothing)."""
    V, train = dm.vocab_size, dm.train_ids
    unigram = torch.bincount(train, minlength=V).double() + 0.5  # [V]
    unigram /= unigram.sum()
    pairs, counts = torch.unique(train[:-1] * V + train[1:], return_counts=True)  # sorted pair ids
    firsts = torch.bincount(train[:-1], minlength=V).double()  # [V]
    xs, ys = zip(*dm.val_dataloader(), strict=True)
    x, y = torch.cat(xs).flatten(), torch.cat(ys).flatten()  # [N] each
    wanted = x * V + y  # [N]
    at = torch.searchsorted(pairs, wanted).clamp(max=len(pairs) - 1)  # [N]
    pair_counts = torch.where(pairs[at] == wanted, counts[at], 0).double()  # [N]
    bigram = (pair_counts + smoothing * unigram[y]) / (firsts[x] + smoothing)  # [N]
    return {"unigram": float(-unigram[y].log().mean()), "bigram": float(-bigram.log().mean())}
