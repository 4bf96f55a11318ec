"""Character-level data for the training lab: text in, ``(x, y)`` batches of character ids out.

    dm = CharDataModule()                      # the embedded corpus (CPython's pydoc help topics)
    dm = CharDataModule(paths=["book.txt"])    # any UTF-8 text file(s)
    dm.vocab_size, dm.unigram_entropy, dm.bigram_entropy

Batches are ``(x, y)``, both long ``[B, T]``, with ``y`` the next character after each of ``x``. The
training stream is endless random windows whose order is a pure function of ``(seed, batch index)``;
the loader starts at the batch the trainer has reached, so a run resumed from a checkpoint sees
exactly the batches an uninterrupted run would (Lightning restores the step, not a loader's position).

The two reference lines of the stall experiment are entropies of the training split in nats/char:
``unigram_entropy`` H(X) is the best loss a model can reach ignoring context; ``bigram_entropy``
H(X_t | X_t-1) is the best loss reading one character back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lab.corpora import embedded_corpus
from lab.errors import UserError


class DataError(UserError):
    """Unusable data or data settings; the message names the problem in one line."""


def read_texts(paths: list[str]) -> str:
    """The UTF-8 files ``paths`` joined by blank lines, or a ``DataError`` naming the bad file."""
    parts = []
    for path in paths:
        try:
            raw = Path(path).read_bytes()
        except OSError as err:
            raise DataError(f"cannot read {path}: {err.strerror}") from None
        if not raw:
            raise DataError(f"{path} is empty")
        try:
            parts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DataError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    return "\n\n".join(parts)


def entropies(ids: torch.Tensor, vocab_size: int) -> tuple[float, float]:
    """Unigram H(X) and bigram conditional H(X_t | X_t-1) of a 1-D id sequence, in nats."""
    counts = torch.bincount(ids, minlength=vocab_size).double()  # [V]
    pair_counts = torch.bincount(ids[:-1] * vocab_size + ids[1:], minlength=vocab_size**2).double()  # [V*V]
    first_counts = pair_counts.view(vocab_size, vocab_size).sum(dim=1)  # [V] counts of the first char

    def entropy(c: torch.Tensor) -> float:
        p = c[c > 0] / c.sum()
        return float(-(p * p.log()).sum())

    # H(X_t | X_t-1) = H(X_t-1, X_t) - H(X_t-1)
    return entropy(counts), max(entropy(pair_counts) - entropy(first_counts), 0.0)


class RandomWindows(Dataset):
    """Batch ``i`` is ``batch_size`` random windows drawn by a generator seeded from ``(seed, i)``."""

    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.ids, self.seq_len, self.batch_size, self.seed = ids, seq_len, batch_size, seed
        self.offsets = torch.arange(seq_len + 1)  # [T+1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # torch's CPU generator keeps only 32 bits of a seed: hash the pair into them.
        digest = hashlib.blake2b(f"{self.seed}:{i}".encode(), digest_size=4).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        starts = torch.randint(0, len(self.ids) - self.seq_len, (self.batch_size,), generator=generator)
        windows = self.ids[starts[:, None] + self.offsets]  # [B, T+1]
        return windows[:, :-1], windows[:, 1:]  # x, y: [B, T] each


class StepSampler(Sampler[int]):
    """Endless batch indices from ``start``: rank r of w takes ``start*w + r``, ``(start+1)*w + r``, ..."""

    def __init__(self, start: int, rank: int = 0, world_size: int = 1):
        self.start, self.rank, self.world_size = start, rank, world_size

    def __iter__(self) -> Iterator[int]:
        step = self.start
        while True:
            yield step * self.world_size + self.rank
            step += 1


class EvenWindows(Dataset):
    """A fixed validation set: ``n_batches`` batches of windows spread evenly over the split."""

    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, n_batches: int):
        n_windows = n_batches * batch_size
        starts = torch.linspace(0, len(ids) - seq_len - 1, n_windows).long()  # [N]
        self.windows = ids[starts[:, None] + torch.arange(seq_len + 1)]  # [N, T+1]
        self.batch_size = batch_size

    def __len__(self) -> int:
        return len(self.windows) // self.batch_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.windows[i * self.batch_size : (i + 1) * self.batch_size]  # [B, T+1]
        return windows[:, :-1], windows[:, 1:]  # x, y: [B, T] each


class CharDataModule(L.LightningDataModule):
    """Characters of a text as tokens; the vocabulary is the sorted set of characters in the text.

    The text is read when the module is built (not in ``setup``): the vocabulary size must be known
    before the model is, and `blocklab fit` links ``vocab_size`` into ``model.config.vocab_size``.
    """

    def __init__(
        self,
        paths: list[str] | None = None,
        seq_len: int = 64,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        val_batches: int = 8,
        seed: int = 1,
        num_workers: int = 0,
    ):
        """
        Args:
            paths: UTF-8 text files to train on, joined in order; default: the embedded corpus.
            seq_len: Characters per training window (T); at most the model's block_size.
            batch_size: Windows per batch (B).
            val_fraction: The last part of the text held out for validation.
            val_batches: Validation batches, spread evenly over the held-out part.
            seed: Seeds the order of the training windows (a pure function of seed and step).
            num_workers: DataLoader worker processes.
        """
        super().__init__()
        self.save_hyperparameters()
        if seq_len < 1 or batch_size < 1 or val_batches < 1:
            raise DataError(
                f"seq_len, batch_size, val_batches must be >= 1: {seq_len}, {batch_size}, {val_batches}"
            )
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
        text = read_texts(paths) if paths else embedded_corpus()
        self.vocab = "".join(sorted(set(text)))
        self._index = {ch: i for i, ch in enumerate(self.vocab)}
        ids = self.encode(text)  # [N]
        n_val = int(len(ids) * val_fraction)
        self.train_ids, self.val_ids = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
        source = ", ".join(paths) if paths else "the embedded corpus"
        for split, part in (("training", self.train_ids), ("validation", self.val_ids)):
            if len(part) <= seq_len:
                raise DataError(
                    f"{source}: the {split} split has {len(part)} characters, fewer than one sequence "
                    f"of seq_len={seq_len} plus its target; use more text or a shorter seq_len"
                )
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.val_batches, self.num_workers = val_batches, num_workers
        self.unigram_entropy, self.bigram_entropy = entropies(self.train_ids, self.vocab_size)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def baselines(self) -> dict[str, float]:
        """Reference losses (nats/char) that ``LitGPT`` logs as ``baseline/<name>``."""
        return {"unigram": self.unigram_entropy, "bigram": self.bigram_entropy}

    def encode(self, text: str) -> torch.Tensor:
        unknown = set(text) - self._index.keys()
        if unknown:
            raise DataError(f"characters outside the vocabulary: {''.join(sorted(unknown))!r}")
        return torch.tensor([self._index[ch] for ch in text], dtype=torch.long)  # [N]

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.vocab[i] for i in torch.as_tensor(ids).tolist())

    def train_dataloader(self) -> DataLoader:
        # Start at the batch the trainer has reached: after a resume, global_step is already restored.
        trainer = self.trainer
        start, rank, world_size = 0, 0, 1
        if trainer is not None:
            start = trainer.global_step * trainer.accumulate_grad_batches
            rank, world_size = trainer.global_rank, trainer.world_size
        windows = RandomWindows(self.train_ids, self.seq_len, self.batch_size, self.seed)
        sampler = StepSampler(start, rank, world_size)
        return DataLoader(windows, batch_size=None, sampler=sampler, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        windows = EvenWindows(self.val_ids, self.seq_len, self.batch_size, self.val_batches)
        return DataLoader(windows, batch_size=None, num_workers=self.num_workers)

    def state_dict(self) -> dict:
        """Saved in every checkpoint, so a checkpoint can decode its own outputs."""
        return {"vocab": self.vocab}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["vocab"] != self.vocab:
            raise DataError("the checkpoint was trained on a different vocabulary than this text's")
