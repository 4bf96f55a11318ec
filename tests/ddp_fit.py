"""Two CPU processes (DDP over gloo) train a tiny model for a few steps; run by tests/test_train.py.

    python tests/ddp_fit.py OUT_DIR TEXT_FILE

Lightning's launcher starts rank 1 by running this same command again. Rank 1's third training loss is
made NaN, so the NaN guard's skip must be agreed across ranks. Each rank saves what it saw and its
final weights to OUT_DIR/rank<r>.pt.
"""

import sys
from pathlib import Path

import lightning as L
import torch

from lab.config import GPTConfig
from lab.data import CharDataModule
from lab.train import LitGPT, make_trainer


class SeenBatches(L.Callback):
    def __init__(self):
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[0].flatten().tolist())


def main(out: Path, text_file: str) -> None:
    torch.set_num_threads(1)
    L.seed_everything(1, verbose=False)
    lit = LitGPT(GPTConfig(n_layer=2, n_embd=16, block_size=16, vocab_size=64))
    forward, calls = lit.model.forward, []

    def poisoned(idx, *args, **kwargs):
        logits = forward(idx, *args, **kwargs)
        if lit.model.training:
            calls.append(1)
            if len(calls) == 3 and lit.global_rank == 1:
                return logits * float("nan")
        return logits

    lit.model.forward = poisoned
    seen = SeenBatches()
    trainer = make_trainer(5, accelerator="cpu", devices=2, strategy="ddp", callbacks=[seen])
    trainer.fit(lit, CharDataModule(paths=[text_file], seq_len=16, batch_size=4, val_batches=2))
    state = {
        "batches": seen.batches,
        "weights": {k: v.clone() for k, v in lit.model.state_dict().items()},
        "nonfinite_steps": lit.nonfinite_steps,
        "global_step": trainer.global_step,
        "val_loss": float(trainer.callback_metrics["val/loss"]),
    }
    torch.save(state, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
