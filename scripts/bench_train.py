"""Training step time of LitGPT under the Lightning Trainer vs a plain torch loop, as a ratio.

    python scripts/bench_train.py                     # the stall cpu model, 40 steps x 3 per leg
    python scripts/bench_train.py --steps 20 --width 128 --heads 4
    python scripts/bench_train.py --json              # the numbers as one JSON object

Both legs train the same model (lab.model.GPT, same init), with the same AdamW groups and schedule (from
LitGPT.configure_optimizers), on the same batches (lab.data.RandomWindows), with gradient clipping at 1.0.
The Lightning leg runs the Trainer every run of the lab gets (``lab.train.make_trainer``: TensorBoard
logging every step, the NaN guard, grad_norm), as the stall experiment does. Legs alternate,
``--repeats`` times each, and the best time of each is compared, so load from other processes hits
both alike. The first ``--skip`` steps of every leg are not timed.
"""

from __future__ import annotations

import logging
import tempfile
import time
from json import dumps

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger

from lab import flags
from lab.config import GPTConfig
from lab.data import CharDataModule, RandomWindows
from lab.stall.cli import load_preset
from lab.train import LitGPT, make_trainer


class StepTimer(L.Callback):
    def __init__(self, skip: int):
        self.skip, self.start, self.end = skip, 0.0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.skip:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end = time.perf_counter()


def plain_loop(lit: LitGPT, windows: RandomWindows, steps: int, skip: int) -> float:
    """Seconds per step of a hand-written loop over the same model, optimiser and batches."""
    setup = lit.configure_optimizers()
    optimizer, scheduler = setup["optimizer"], setup["lr_scheduler"]["scheduler"]
    model = lit.model.train()
    for step in range(steps):
        if step == skip:
            start = time.perf_counter()
        x, y = windows[step]  # [B, T] each
        logits = model(x)  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss.item()  # what a loop that logs its loss pays for the sync
    return (time.perf_counter() - start) / (steps - skip)


def lightning_loop(lit: LitGPT, data: CharDataModule, steps: int, skip: int, log_dir: str) -> float:
    timer = StepTimer(skip)
    logger = TensorBoardLogger(log_dir, name="", version="bench")
    trainer = make_trainer(steps, limit_val_batches=0, logger=logger, callbacks=[timer])
    trainer.fit(lit, data)
    return (timer.end - timer.start) / (steps - skip)


def main(
    width: int | None = None,
    heads: int | None = None,
    layers: int | None = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    steps: int = 40,
    skip: int = 5,
    repeats: int = 3,
    json: bool = False,
) -> None:
    """Time both legs and print their best times and the ratio.

    Args:
        width: The model's width (default: the stall experiment's cpu preset's, as for the next four).
        heads: Attention heads per block.
        layers: Blocks.
        seq_len: Characters per training window.
        batch_size: Windows per batch.
        steps: Training steps per leg.
        skip: The first steps of each leg, not timed.
        repeats: Times each leg runs; the best of each is compared.
        json: Print the numbers as one JSON object instead.
    """
    cpu = load_preset("cpu")
    width, heads, layers = width or cpu.n_embd, heads or cpu.n_head, layers or cpu.n_layer
    seq_len, batch_size = seq_len or cpu.seq_len, batch_size or cpu.batch_size
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    data = CharDataModule(seq_len=seq_len, batch_size=batch_size)
    windows = RandomWindows(data.train_ids, seq_len, batch_size, data.seed)
    config = GPTConfig(
        n_layer=layers, n_head=heads, n_embd=width, vocab_size=data.vocab_size, block_size=seq_len
    )

    def fresh_model() -> LitGPT:
        torch.manual_seed(0)
        return LitGPT(config, lr=1e-3)

    plain, lightning = [], []
    with tempfile.TemporaryDirectory() as log_dir:
        for _ in range(repeats):
            plain.append(plain_loop(fresh_model(), windows, steps, skip))
            lightning.append(lightning_loop(fresh_model(), data, steps, skip, log_dir))
    result = {
        "model": {"layers": layers, "width": width, "batch": batch_size, "seq": seq_len},
        "threads": torch.get_num_threads(),
        "timed_steps": steps - skip,
        "plain_ms_per_step": min(plain) * 1e3,
        "lightning_ms_per_step": min(lightning) * 1e3,
        "ratio": min(lightning) / min(plain),
    }
    if json:
        print(dumps(result))
    else:
        report(result, plain, lightning, repeats)


def report(result: dict, plain: list[float], lightning: list[float], repeats: int) -> None:
    model = result["model"]
    print(
        f"model: {model['layers']} blocks, width {model['width']}, batch {model['batch']}x{model['seq']}, "
        f"{result['threads']} threads, {result['timed_steps']} timed steps x {repeats} repeats"
    )
    for name, times in (("plain torch loop", plain), ("Lightning", lightning)):
        every = ", ".join(f"{t * 1e3:.1f}" for t in times)
        print(f"{name + ':':18} {min(times) * 1e3:.1f} ms/step (each repeat: {every})")
    print(f"ratio Lightning / plain: {result['ratio']:.3f} (target <= 1.05)")


if __name__ == "__main__":
    flags.call(main)
