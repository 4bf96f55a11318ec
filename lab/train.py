"""The training lab's Lightning side: ``LitGPT`` owns loss, metrics, optimiser and schedule; the CLI.

    blocklab fit --config configs/postln.yaml --trainer.max_steps 50
    blocklab fit --config configs/postln.yaml --ckpt_path last        # resume runs/postln
    blocklab validate --config configs/postln.yaml --ckpt_path runs/postln/checkpoints/last.ckpt

``LitGPT`` is handed a ``GPTConfig`` and trains ``lab.model.GPT`` on any data module whose batches are
``(x, y)`` long tensors ``[B, T]`` with ``y`` the next token of each ``x``. It reads three optional
attributes of the data module: ``seq_len`` and ``vocab_size`` (checked against the model before
training starts) and ``baselines`` (``{name: nats}``, logged as ``baseline/<name>`` lines).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torchmetrics import MeanMetric

from lab.config import GPTConfig
from lab.data import CharDataModule, DataError
from lab.errors import UserError
from lab.gradients import block_grad_norms, block_weights, update_ratios
from lab.model import GPT
from lab.optim import muon_adamw
from lab.threads import ThreadTuner

TINY = GPTConfig()  # the dataclass's defaults: a tiny valid model


def learning_rate(
    step: int,
    lr: float,
    warmup_steps: int = 0,
    schedule: Literal["constant", "cosine"] = "constant",
    min_lr: float = 0.0,
    max_steps: int | None = None,
) -> float:
    """The learning rate of optimiser step ``step`` (0-based): linear warmup, then constant or cosine.

    Warmup reaches ``lr`` at step ``warmup_steps - 1``; cosine falls from ``lr`` after warmup to
    ``min_lr`` at ``max_steps`` and stays there.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if max_steps is None or max_steps <= warmup_steps:
        raise ValueError(
            f"a cosine schedule needs max_steps > warmup_steps ({warmup_steps}), got {max_steps}"
        )
    progress = min((step - warmup_steps) / (max_steps - warmup_steps), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class LitGPT(L.LightningModule):
    """A GPT trained for next-token cross entropy with AdamW, warmup and a constant or cosine schedule.

    Args:
        config: The model's shape and variant (or a dict of its fields, as checkpoints store it);
            the CLI sets vocab_size from the data module.
        lr: Peak learning rate of AdamW.
        betas: AdamW's moment decay rates.
        weight_decay: Decoupled weight decay, applied to matrices only (weights and embedding
            tables); biases and LayerNorm parameters are not decayed.
        warmup_steps: Optimiser steps of linear warmup from lr/warmup_steps to lr (0: none).
        schedule: After warmup, hold lr (constant) or follow a cosine down to min_lr (cosine).
        min_lr: Where the cosine ends.
        max_steps: Where the cosine ends; default: the trainer's max_steps.
        block_stats_first: Log each block's gradient norm (grad_norm/blocks.{i}, and of its
            mlp.c_proj.weight) and Adam's update-to-weight ratio (update_ratio/blocks.{i}) on each
            of the first this many steps (0: none). They cost a copy of the blocks' weights a step.
        block_stats_every: And on every this many steps after those (0: never).
        layer_dropout: LayerSkip's layer dropout, the rate of the last block: block l of L is
            skipped (its stream passes through) per sequence with probability
            layer_dropout * (2^(l/(L-1)) - 1), none for the first, rising with depth (0: off).
        layer_dropout_curriculum: constant, or exponential: the rates grow over training by
            2^(step/max_steps) - 1, from none to full.
        early_exit_loss: LayerSkip's early-exit loss: every block's read-out (ln_f and the tied
            unembedding) also learns the next token, block l weighted early_exit_loss * (l+1)
            against the last block's L, normalised (0: off). Logged as
            train/exit_loss/blocks.{l} and, per validation, val/exit_loss/blocks.{l}.
        early_exit_every: The rotational curriculum: each step only every this-many-th block's
            read-out is trained, rotating with the step, to keep the cost down (1: all).
        early_exit_tokens: The share of a training batch's positions (drawn afresh each step) whose
            early-exit losses are computed: each read-out is a whole unembedding, which at a large
            vocabulary and a narrow width costs as much as all the blocks (1: every position).
        optimizer: adamw for every parameter, or muon: Muon (``lab.optim``) for the blocks'
            weight matrices and AdamW (lr, betas, weight_decay) for the tables, norms and biases.
        muon_lr: Muon's peak learning rate; the schedule scales it as it scales lr.
        train_seconds: A wall-clock budget the schedule also follows: it stands at whichever is
            further along, the step or the elapsed share of train_seconds of max_steps, so a
            machine slower than planned still ends its cosine on time (None: steps only).
    """

    def __init__(
        self,
        config: GPTConfig = TINY,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        schedule: Literal["constant", "cosine"] = "constant",
        min_lr: float = 0.0,
        max_steps: int | None = None,
        block_stats_first: int = 0,
        block_stats_every: int = 0,
        layer_dropout: float = 0.0,
        layer_dropout_curriculum: Literal["constant", "exponential"] = "constant",
        early_exit_loss: float = 0.0,
        early_exit_every: int = 1,
        early_exit_tokens: float = 1.0,
        optimizer: Literal["adamw", "muon"] = "adamw",
        muon_lr: float = 0.02,
        train_seconds: float | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        # A checkpoint holds the config as a plain dict, so it loads with torch.load(weights_only=True).
        self.config = GPTConfig(**config) if isinstance(config, dict) else replace(config)
        self.hparams["config"] = asdict(self.config)
        self.model = GPT(self.config)
        self.val_loss = MeanMetric()
        self.nonfinite_steps = 0
        self.grad_norm: torch.Tensor | None = None  # of the current step, before clipping
        self.weights_before: list[list[torch.Tensor]] | None = None  # the blocks', on a block-stats step
        self.skip_update = False  # this step's loss was not finite: drop its gradients
        self.baselines: dict[str, float] = {}
        if (
            not 0.0 <= layer_dropout < 1.0
            or early_exit_loss < 0.0
            or early_exit_every < 1
            or not 0.0 < early_exit_tokens <= 1.0
        ):
            raise UserError(
                f"layer_dropout must be in [0, 1), early_exit_loss >= 0, early_exit_every >= 1 and "
                f"early_exit_tokens in (0, 1]; got {layer_dropout}, {early_exit_loss}, {early_exit_every}, "
                f"{early_exit_tokens}"
            )
        self.val_exit_loss = torch.nn.ModuleList(MeanMetric() for _ in range(self.config.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)  # [B, T, V]

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule if self.trainer is not None else None
        seq_len = getattr(data, "seq_len", None)
        if seq_len is not None and seq_len > self.config.block_size:
            raise DataError(
                f"seq_len {seq_len} is longer than the model's block_size {self.config.block_size}"
            )
        vocab_size = getattr(data, "vocab_size", None)
        if vocab_size is not None and vocab_size > self.config.vocab_size:
            raise DataError(
                f"the data has {vocab_size} tokens, the model's vocab_size is {self.config.vocab_size}"
            )
        self.baselines = dict(getattr(data, "baselines", {}))

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor | None:
        """The objective of the batch, logged as ``{stage}/loss`` and ``{stage}/bpc`` (validation: the
        model's own loss), with each block's exit loss under LayerSkip's recipe.

        A non-finite training loss on any rank returns None on every rank (nothing is logged).
        """
        x, y = batch  # [B, T] each
        training = stage == "train"
        loss, exit_losses = self.objective(x, y, training)
        if training:
            # Every rank must agree to skip, or DDP would wait forever for a skipping rank's gradients.
            if not self.trainer.strategy.reduce_boolean_decision(bool(torch.isfinite(loss)), all=True):
                return None
            self.log("train/loss", loss, prog_bar=True)  # this step's value: the mixed objective
            self.log("train/bpc", loss / math.log(2))
            for i, exit_loss in exit_losses.items():
                self.log(f"train/exit_loss/blocks.{i}", exit_loss)
        else:
            # The mean over the whole validation set, per validation run.
            self.val_loss.update(loss)
            self.log(f"{stage}/loss", self.val_loss, prog_bar=True)
            for i, exit_loss in exit_losses.items():
                self.val_exit_loss[i].update(exit_loss)
        return loss

    def objective(
        self, x: torch.Tensor, y: torch.Tensor, training: bool = True
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """What a step minimises for tokens x and targets y [B, T]: the cross entropy, or under
        LayerSkip's recipe the last block's loss mixed with this step's early-exit losses (under layer
        dropout when training). Returns it and the exit losses by block, detached (validation: the
        model's own loss, and every block's exit loss)."""
        hp, L = self.hparams, self.config.n_layer
        if hp.layer_dropout == 0 and hp.early_exit_loss == 0:
            logits = self.model(x)  # [B, T, V]
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), {}  # mean over B*T tokens
        keep = None
        if training and hp.layer_dropout > 0:
            rates = self.layer_dropout_rates(self.global_step).to(x.device)  # [L]
            keep = torch.rand(L, x.size(0), device=x.device) >= rates[:, None]  # [L, B]
        taps: dict[int, torch.Tensor] = {}
        stream = self.model.residual_stream(x, layer_keep=keep, taps=taps)  # [B, T, D]
        last = F.cross_entropy(self.model.unembed(stream).flatten(0, 1).float(), y.flatten())
        if hp.early_exit_loss == 0:
            return last, {}
        targets = y.flatten()  # [B*T]
        positions = slice(None)
        if training:
            blocks = [i for i in range(L - 1) if (i + self.global_step) % hp.early_exit_every == 0]
            if hp.early_exit_tokens < 1.0:
                count = max(1, round(hp.early_exit_tokens * targets.numel()))
                positions = torch.randperm(targets.numel(), device=x.device)[:count]  # [N]
        else:
            blocks = list(range(L - 1))
        total, weight = L * last, float(L)
        exit_losses = {}
        for i in blocks:
            read = taps[i].flatten(0, 1)[positions]  # [N, D]: the stream after block i
            exit_loss = F.cross_entropy(self.model.unembed(read).float(), targets[positions])
            scale = hp.early_exit_loss * (i + 1)
            total, weight = total + scale * exit_loss, weight + scale
            exit_losses[i] = exit_loss.detach()
        exit_losses[L - 1] = last.detach()
        if not training:
            return last, exit_losses
        return total / weight, exit_losses

    def layer_dropout_rates(self, step: int) -> torch.Tensor:
        """Per block, the probability a sequence skips it at optimiser step ``step``. [L]."""
        hp, L = self.hparams, self.config.n_layer
        depth = torch.arange(L, dtype=torch.float32) / max(1, L - 1)  # 0 .. 1
        rates = hp.layer_dropout * (torch.pow(2.0, depth) - 1.0)  # [L]
        if hp.layer_dropout_curriculum == "exponential":
            total = hp.max_steps or self.trainer.max_steps
            rates = rates * (2.0 ** min(step / max(1, total), 1.0) - 1.0)
        return rates

    def on_validation_epoch_end(self) -> None:
        # The metrics have already gathered every rank's batches; sync_dist keeps Lightning from warning
        self.log("val/bpc", self.val_loss.compute() / math.log(2), sync_dist=True)
        if self.hparams.early_exit_loss > 0:
            for i, metric in enumerate(self.val_exit_loss):
                self.log(f"val/exit_loss/blocks.{i}", metric.compute(), sync_dist=True)
                metric.reset()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict:
        """The loss; ``skipped`` is True on a step whose loss was not finite (no update is made)."""
        loss = self._step(batch, "train")
        skipped = loss is None
        if skipped:
            # Skip the update (Lightning's default would train on a NaN). Returning None would skip
            # backward, but Lightning refuses it under DDP (a rank that skips backward never joins the
            # gradient all-reduce): every rank backpropagates a zero that reaches each parameter, and
            # on_before_optimizer_step drops those gradients so AdamW leaves every parameter as it was.
            loss = sum(p.sum() for p in self.parameters()) * 0.0
            self.skip_update = True
            self.nonfinite_steps += 1
        self.log("train/nonfinite_steps", float(self.nonfinite_steps))
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        for name, nats in self.baselines.items():
            self.log(f"baseline/{name}", nats)
        return {"loss": loss, "skipped": skipped}

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.skip_update:
            optimizer.zero_grad(set_to_none=True)  # AdamW skips parameters without a gradient
            self.skip_update, self.grad_norm = False, None
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None  # None: a skipped step
        if self.grad_norm is None:
            return
        self.log("grad_norm", self.grad_norm)  # before clipping (configure_gradient_clipping runs next)
        if not torch.isfinite(self.grad_norm):
            # A finite loss can still overflow in backward: drop the gradients so AdamW skips every
            # parameter (and clipping has nothing to scale), and count the step as skipped.
            optimizer.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            self.log("train/nonfinite_steps", float(self.nonfinite_steps))
            return
        if self.block_stats_due():
            for name, values in block_grad_norms(self.model).items():
                suffix = "" if name == "blocks" else f".{name}"
                for i, value in enumerate(values):
                    self.log(f"grad_norm/blocks.{i}{suffix}", value)
            self.weights_before = block_weights(self.model)

    def block_stats_due(self) -> bool:
        """Whether this optimiser step logs the per-block statistics (``block_stats_first``/``_every``)."""
        step, hp = self.global_step, self.hparams
        return step < hp.block_stats_first or bool(hp.block_stats_every and step % hp.block_stats_every == 0)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.weights_before is None:
            return
        for i, ratio in enumerate(update_ratios(self.model, self.weights_before)):
            self.log(f"update_ratio/blocks.{i}", ratio)
        self.weights_before = None

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        if self.grad_norm is None or not torch.isfinite(self.grad_norm):
            return
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            # The trainer's gradient_clip_val, reusing the norm just measured instead of a second pass.
            params = [p for p in self.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, self.grad_norm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "muon":
            optimizer = muon_adamw(self.model, hp.muon_lr, hp.lr, tuple(hp.betas), hp.weight_decay)
        else:
            decay = [p for p in self.model.parameters() if p.dim() >= 2]
            no_decay = [p for p in self.model.parameters() if p.dim() < 2]
            groups = [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ]
            optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        max_steps = hp.max_steps
        if max_steps is None and (hp.schedule == "cosine" or hp.train_seconds):
            max_steps = self.trainer.max_steps
        learning_rate(hp.warmup_steps, 1.0, hp.warmup_steps, hp.schedule, 0.0, max_steps)  # fail early
        started = time.monotonic()

        def factor(step: int) -> float:  # of each param group's own peak rate
            if hp.train_seconds:
                step = max(step, int(max_steps * (time.monotonic() - started) / hp.train_seconds))
            return learning_rate(step, 1.0, hp.warmup_steps, hp.schedule, hp.min_lr / hp.lr, max_steps)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["nonfinite_steps"] = self.nonfinite_steps

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.nonfinite_steps = checkpoint.get("nonfinite_steps", 0)


class FreeCoreThreads(L.Callback):
    """torch's threads re-chosen every few seconds of training from the cores other processes leave
    free (``lab.threads.ThreadTuner``): a run that another job joins halfway keeps its pace instead
    of waiting at every step for a thread that shares that job's core."""

    def __init__(self, tuner: ThreadTuner | None = None):
        self.tuner = tuner  # one already measuring (its window started earlier), or made at the start
        self.chosen: set[int] = set()  # every thread count the run used

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.tuner = self.tuner or ThreadTuner()
        self.tuner.tick()
        self.chosen.add(torch.get_num_threads())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        threads = self.tuner.tick()
        if threads is not None:
            self.chosen.add(threads)


# The data is an endless random-window stream (lab.data): there are no epochs, so validation runs every
# val_check_interval steps, and the loader must not be replaced by a DistributedSampler (it splits the
# stream across ranks itself). Every Trainer of the lab has these: make_trainer's and `blocklab fit`'s.
STREAM_TRAINER_ARGS = {"check_val_every_n_epoch": None, "use_distributed_sampler": False}

# What an experiment's or a script's run shares; make_trainer's arguments override any of them.
RUN_TRAINER_ARGS = {
    **STREAM_TRAINER_ARGS,
    # One device per run, whatever the machine has: DDP over several would multiply the batch and change
    # the experiment (a multi-GPU machine runs variants side by side: docs/training.md).
    "devices": 1,
    "num_sanity_val_steps": 0,
    "gradient_clip_val": 1.0,
    "logger": False,
    "log_every_n_steps": 1,
    # the caller reports its own progress and keeps what it needs (no checkpoints)
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def make_trainer(max_steps: int, **trainer_args: Any) -> L.Trainer:
    """The Trainer of one run over ``lab.data``'s stream: ``max_steps`` steps, validation once after the
    last (unless ``val_check_interval``), ``RUN_TRAINER_ARGS`` for the rest; ``trainer_args`` are any of
    ``L.Trainer``'s and override those (``logger=``, ``callbacks=``, ``precision=``, ``devices=2,
    strategy="ddp"``...). `blocklab fit` builds its Trainer from YAML instead (``TRAINER_DEFAULTS``)."""
    run = {"max_steps": max_steps, "val_check_interval": max_steps}
    return L.Trainer(**{**RUN_TRAINER_ARGS, **run, **trainer_args})


# Defaults of `blocklab fit`: one run directory runs/<version> holds the TensorBoard events, config.yaml
# and checkpoints/. The version is pinned, so a restart finds runs/<version>/checkpoints/last.ckpt again
# (an unpinned logger would move on to a new version_N folder and `--ckpt_path last` would find nothing).
TRAINER_DEFAULTS = {
    **STREAM_TRAINER_ARGS,
    "max_steps": 300,
    "val_check_interval": 100,
    "gradient_clip_val": 1.0,
    "log_every_n_steps": 1,
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "", "version": "default"},
    },
}


@dataclass
class StallPresetOption:
    """A run of the stall experiment."""

    stall_preset: str | None = None
    """A preset of `blocklab stall` (configs/stall/NAME.yaml): its model, optimiser, data, steps and first
    seed are this run's defaults, below every --config and flag (configs/preln.yaml: cpu)."""


class LabCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_class_arguments(StallPresetOption)
        parser.add_lightning_class_args(L.pytorch.callbacks.ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0})
        parser.set_defaults({"checkpoint.every_n_train_steps": 100})
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")

    def after_fit(self) -> None:
        # ModelCheckpoint writes last.ckpt every N steps, and at the end only if it never wrote one:
        # a run of 350 steps would leave step 300. Write the final state, for `--ckpt_path last`.
        checkpoint = self.trainer.checkpoint_callback
        if checkpoint is None or not checkpoint.save_last or checkpoint.dirpath is None:
            return
        if not self.trainer.fast_dev_run:
            self.trainer.save_checkpoint(Path(checkpoint.dirpath) / f"{checkpoint.CHECKPOINT_NAME_LAST}.ckpt")

    def parse_arguments(self, parser, args) -> None:
        # args always comes from `blocklab` (lab.cli), which also leaves it in sys.argv: the base class
        # would warn about getting both.
        # --print_config prints and exits where it stands: the first pass, which finds the preset, skips it
        config = parser.parse_args([arg for arg in args if not arg.startswith("--print_config")])
        subcommand = config.get("subcommand")
        preset = (config[subcommand] if subcommand else config).stall_preset
        if preset is not None:  # parse again, the preset's settings first: any config or flag overrides them
            from lab.stall.cli import load_preset

            at = args.index(subcommand) + 1 if subcommand else 0
            settings = json.dumps(load_preset(preset).fit_config())
            config = parser.parse_args([*args[:at], "--config", settings, *args[at:]])
        elif any(arg.startswith("--print_config") for arg in args):
            config = parser.parse_args(args)
        self.config = config


def _missing_checkpoint(argv: list[str]) -> str | None:
    """The ``--ckpt_path`` given that names no file (Lightning's "best", "last", ... aside), or None.
    Lightning would look for it only after the run directory and its logs were written."""
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--ckpt_path" and i + 1 < len(argv) else None
        path = arg.partition("=")[2] if arg.startswith("--ckpt_path=") else path
        if path and path not in ("best", "last", "hpc", "registry", "null") and not Path(path).exists():
            return path
    return None


def main(argv: list[str]) -> int:
    """``blocklab fit|validate [--config YAML] [overrides]``: argv[0] is the subcommand."""
    missing = _missing_checkpoint(argv)
    if missing is not None:
        raise UserError(f"--ckpt_path {missing}: no such file")
    try:
        LabCLI(
            LitGPT,
            CharDataModule,
            args=argv,
            trainer_defaults=TRAINER_DEFAULTS,
            auto_configure_optimizers=False,
            # a wrong option or a missing --config raises, and lab.cli prints it as one line
            parser_kwargs={"prog": f"blocklab {argv[0]}", "exit_on_error": False},
            save_config_kwargs={"overwrite": True},
        )
    except ArgumentError as error:
        raise UserError(str(error)) from None
    except MisconfigurationException as error:  # e.g. accelerator gpu where there is none: a setting
        raise UserError(str(error)) from None
    return 0
