"""Training step time of LitGPT under the Lightning Trainer vs a plain torch loop, as a ratio.

    python scripts/bench_train.py                     # the stall cpu model, 40 steps x 3 per leg
    python scripts/bench_train.py --steps 20 --width 128 --heads 4
    python scripts/bench_train.py --json              # the numbers as one JSON object

Both legs train the same model (lab.model.GPT, same init), with the same AdamW groups and schedule (from
LitGPT.configure_optimizers), on the same batches (lab.data.RandomWindows), with gradient clipping at 1.0.
The Lightning leg runs the stall experiment's Trainer settings (TensorBoard logging every step, the
NaN guard, grad_norm). Legs alternate, ``--repeats`` times each, and the best time of each is compared,
so load from other processes hits both alike. The first ``--skip`` steps of every leg are not timed.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger

from lab.config import GPTConfig
from lab.data import CharDataModule, RandomWindows
from lab.train import STREAM_TRAINER_ARGS, LitGPT


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
    trainer = L.Trainer(
        **STREAM_TRAINER_ARGS,
        max_steps=steps,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        logger=TensorBoardLogger(log_dir, name="", version="bench"),
        log_every_n_steps=1,
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit, data)
    return (timer.end - timer.start) / (steps - skip)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead")
    args = parser.parse_args()

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    data = CharDataModule(seq_len=args.seq_len, batch_size=args.batch_size)
    windows = RandomWindows(data.train_ids, args.seq_len, args.batch_size, data.seed)
    config = GPTConfig(
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
        vocab_size=data.vocab_size,
        block_size=args.seq_len,
    )

    def fresh_model() -> LitGPT:
        torch.manual_seed(0)
        return LitGPT(config, lr=1e-3)

    plain, lightning = [], []
    with tempfile.TemporaryDirectory() as log_dir:
        for _ in range(args.repeats):
            plain.append(plain_loop(fresh_model(), windows, args.steps, args.skip))
            lightning.append(lightning_loop(fresh_model(), data, args.steps, args.skip, log_dir))
    if args.json:
        result = {
            "model": {
                "layers": args.layers,
                "width": args.width,
                "batch": args.batch_size,
                "seq": args.seq_len,
            },
            "threads": torch.get_num_threads(),
            "timed_steps": args.steps - args.skip,
            "plain_ms_per_step": min(plain) * 1e3,
            "lightning_ms_per_step": min(lightning) * 1e3,
            "ratio": min(lightning) / min(plain),
        }
        print(json.dumps(result))
        return
    print(
        f"model: {args.layers} blocks, width {args.width}, batch {args.batch_size}x{args.seq_len}, "
        f"{torch.get_num_threads()} threads, {args.steps - args.skip} timed steps x {args.repeats} repeats"
    )
    for name, times in (("plain torch loop", plain), ("Lightning", lightning)):
        every = ", ".join(f"{t * 1e3:.1f}" for t in times)
        print(f"{name + ':':18} {min(times) * 1e3:.1f} ms/step (each repeat: {every})")
    print(f"ratio Lightning / plain: {min(lightning) / min(plain):.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
