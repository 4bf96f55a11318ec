import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lab import cli
from lab.config import GPTConfig
from lab.data import CharDataModule
from lab.gradients import grad_norms_at_init
from lab.train import LitGPT, learning_rate, main, make_trainer

TINY_MODEL = ["--model.config.n_layer", "2", "--model.config.n_head", "2", "--model.config.n_embd", "16"]
TINY_DATA = ["--model.config.block_size", "16", "--data.seq_len", "16", "--data.batch_size", "4"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def text_file(tmp_path) -> str:
    path = tmp_path / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    return str(path)


def tiny_fit_args(run_dir: Path, text_file: str, *extra: str) -> list[str]:
    return [
        "fit",
        *TINY_MODEL,
        *TINY_DATA,
        "--data.paths",
        f"[{text_file}]",
        "--data.val_batches",
        "2",
        "--seed_everything",
        "1",
        "--model.warmup_steps",
        "4",
        "--trainer.logger.init_args.save_dir",
        str(run_dir.parent),
        "--trainer.logger.init_args.version",
        run_dir.name,
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        *extra,
    ]


def tiny_trainer(tmp_path: Path, steps: int, **kwargs) -> L.Trainer:
    return make_trainer(steps, default_root_dir=tmp_path, **kwargs)


def tiny_data(text_file: str) -> CharDataModule:
    return CharDataModule(paths=[text_file], seq_len=16, batch_size=4, val_batches=2)


def test_warmup_then_cosine_values():
    lr, warmup, end = 1e-3, 100, 1000
    assert learning_rate(0, lr, warmup) == pytest.approx(lr / warmup)
    assert learning_rate(warmup // 2, lr, warmup) == pytest.approx(lr * (warmup // 2 + 1) / warmup)
    assert learning_rate(warmup - 1, lr, warmup) == pytest.approx(lr)
    assert learning_rate(warmup, lr, warmup, "cosine", 1e-4, end) == pytest.approx(lr)
    assert learning_rate((warmup + end) // 2, lr, warmup, "cosine", 1e-4, end) == pytest.approx(
        (lr + 1e-4) / 2
    )
    assert learning_rate(end, lr, warmup, "cosine", 1e-4, end) == pytest.approx(1e-4)
    assert learning_rate(end + 50, lr, warmup, "cosine", 1e-4, end) == pytest.approx(1e-4)
    assert learning_rate(5000, lr, warmup, "constant") == lr
    with pytest.raises(ValueError, match="cosine schedule needs max_steps"):
        learning_rate(200, lr, warmup, "cosine")


def test_scheduler_follows_the_schedule_per_step():
    lit = LitGPT(GPTConfig(), lr=1e-3, warmup_steps=4, schedule="cosine", min_lr=1e-4, max_steps=10)
    setup = lit.configure_optimizers()
    optimizer, scheduler = setup["optimizer"], setup["lr_scheduler"]["scheduler"]
    assert setup["lr_scheduler"]["interval"] == "step"
    seen = []
    for _ in range(12):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [learning_rate(s, 1e-3, 4, "cosine", 1e-4, 10) for s in range(12)]
    assert seen == pytest.approx(expected)
    assert all(group["lr"] == optimizer.param_groups[0]["lr"] for group in optimizer.param_groups)


def test_weight_decay_only_on_matrices():
    lit = LitGPT(GPTConfig())
    decay, no_decay = lit.configure_optimizers()["optimizer"].param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): name for name, p in lit.model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "wte.weight" in decayed and "blocks.0.attn.c_attn.weight" in decayed
    assert all(".ln_" not in name and not name.endswith(".bias") for name in decayed)
    assert {names[id(p)] for p in no_decay["params"]} == set(names.values()) - decayed


def test_nonfinite_loss_skips_the_step_and_checkpoints_stay_finite(tmp_path, text_file):
    lit = LitGPT(GPTConfig(n_layer=2, n_embd=16, block_size=16, vocab_size=64))
    forward, calls = lit.model.forward, []

    def poisoned(idx, *args, **kwargs):
        calls.append(1)
        logits = forward(idx, *args, **kwargs)
        return logits * float("nan") if len(calls) == 3 else logits  # the third training step

    lit.model.forward = poisoned
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
    trainer = tiny_trainer(tmp_path, 6, callbacks=[checkpoint], enable_checkpointing=True)
    trainer.fit(lit, tiny_data(text_file))

    assert trainer.global_step == 6
    assert lit.nonfinite_steps == 1
    assert trainer.callback_metrics["train/nonfinite_steps"] == 1
    assert all(torch.isfinite(p).all() for p in lit.parameters())
    adam_steps = {float(state["step"]) for state in trainer.optimizers[0].state.values()}
    assert adam_steps == {5.0}  # six steps, one skipped: no parameter was updated on it
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["nonfinite_steps"] == 1
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())


def test_nonfinite_gradient_skips_the_update(tmp_path, text_file):
    lit = LitGPT(GPTConfig(n_layer=2, n_embd=16, block_size=16, vocab_size=64))
    weight = lit.model.blocks[0].mlp.c_fc.weight
    handle = weight.register_hook(lambda grad: grad * float("inf"))
    trainer = tiny_trainer(tmp_path, 2)
    trainer.fit(lit, tiny_data(text_file))
    handle.remove()
    assert lit.nonfinite_steps == 2
    assert math.isinf(trainer.callback_metrics["grad_norm"])
    assert all(torch.isfinite(p).all() for p in lit.parameters())
    assert not trainer.optimizers[0].state  # AdamW never stepped a parameter


def test_clipping_reuses_the_measured_norm():
    lit = LitGPT(GPTConfig())
    for p in lit.parameters():
        p.grad = torch.full_like(p, 0.5)
    lit.on_before_optimizer_step(optimizer=None)
    measured = lit.grad_norm
    assert measured == pytest.approx(0.5 * math.sqrt(sum(p.numel() for p in lit.parameters())))
    lit.configure_gradient_clipping(None, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    assert torch.nn.utils.get_total_norm([p.grad for p in lit.parameters()]) == pytest.approx(1.0, rel=1e-4)


def test_logs_losses_baselines_lr_and_grad_norm(tmp_path, text_file):
    lit = LitGPT(GPTConfig(n_layer=2, n_embd=16, block_size=16, vocab_size=64), warmup_steps=10)
    data = tiny_data(text_file)
    trainer = tiny_trainer(tmp_path, 3)
    trainer.fit(lit, data)
    seen = trainer.callback_metrics
    assert seen["train/bpc"] == pytest.approx(seen["train/loss"] / math.log(2))
    assert seen["val/bpc"] == pytest.approx(seen["val/loss"] / math.log(2))
    assert seen["baseline/unigram"] == pytest.approx(data.unigram_entropy)
    assert seen["baseline/bigram"] == pytest.approx(data.bigram_entropy)
    assert seen["lr"] == pytest.approx(learning_rate(2, 1e-3, 10))
    assert seen["grad_norm"] > 0
    assert seen["train/nonfinite_steps"] == 0


def test_cli_fast_dev_run_of_the_shipped_configs(tmp_path):
    configs = Path(__file__).parents[1] / "configs"
    args = ["fit", "--config", str(configs / "postln.yaml"), "--config", str(configs / "tiny.yaml")]
    args += ["--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.fast_dev_run", "2"]
    args += ["--trainer.default_root_dir", str(tmp_path)]  # fast_dev_run drops the logger
    assert main(args) == 0


def test_cli_sets_vocab_size_from_the_data_and_keeps_the_run_directory(tmp_path, text_file):
    run_dir = tmp_path / "run"
    args = tiny_fit_args(
        run_dir, text_file, "--trainer.max_steps", "4", "--checkpoint.every_n_train_steps", "2"
    )
    assert main(args) == 0
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    vocab = saved["CharDataModule"]["vocab"]
    assert vocab == "".join(sorted(set(Path(text_file).read_text())))
    restored = LitGPT.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert restored.config.vocab_size == len(vocab) and restored.config.n_embd == 16
    assert (run_dir / "config.yaml").exists() and list(run_dir.glob("events.out.tfevents.*"))


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)


def test_resume_continues_at_the_right_step_with_the_same_weights(tmp_path, text_file):
    every = ["--checkpoint.every_n_train_steps", "4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(tiny_fit_args(straight, text_file, "--trainer.max_steps", "12", *every)) == 0
    assert main(tiny_fit_args(resumed, text_file, "--trainer.max_steps", "6", *every)) == 0
    assert final_state(resumed)["global_step"] == 6  # saved at 4, and the final state at the end
    # A new process would build a new logger: with the pinned version it finds the same last.ckpt.
    assert (
        main(tiny_fit_args(resumed, text_file, "--trainer.max_steps", "12", *every, "--ckpt_path", "last"))
        == 0
    )

    a, b = final_state(straight), final_state(resumed)
    assert a["global_step"] == b["global_step"] == 12
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name


def run_main_expecting_error(args: list[str], capsys) -> str:
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err
    return err


def test_bad_data_gives_one_line_errors(tmp_path, text_file, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    args = tiny_fit_args(tmp_path / "run", text_file, "--trainer.max_steps", "1")
    err = run_main_expecting_error([*args, "--data.paths", f"[{empty}]"], capsys)
    assert err.startswith("blocklab fit: ") and "empty.txt is empty" in err
    err = run_main_expecting_error([*args, "--data.seq_len", "32"], capsys)
    assert "seq_len 32 is longer than the model's block_size 16" in err


def test_unknown_config_key_is_a_usage_error(tmp_path, text_file, capsys):
    args = tiny_fit_args(tmp_path / "run", text_file, "--model.config.n_layers", "3")
    err = run_main_expecting_error(args, capsys)
    assert err.startswith("blocklab fit: ") and "n_layers" in err


@pytest.mark.slow
def test_sigkill_mid_fit_then_resume_matches_an_uninterrupted_run(tmp_path, text_file):
    """Issue 6: kill -9 in the middle of `blocklab fit`, then `--ckpt_path last`."""
    steps, every = 300, 20

    def command(run_dir: Path, *extra: str) -> list[str]:
        args = tiny_fit_args(run_dir, text_file, "--trainer.max_steps", str(steps))
        return [
            sys.executable,
            "-m",
            "lab.cli",
            *args,
            "--checkpoint.every_n_train_steps",
            str(every),
            *extra,
        ]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed"
    last = killed / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    interrupted_at = final_state(killed)["global_step"]
    assert 0 < interrupted_at < steps

    subprocess.run(command(killed, "--ckpt_path", "last"), env=env, check=True, capture_output=True)
    straight = tmp_path / "straight"
    subprocess.run(command(straight), env=env, check=True, capture_output=True)
    a, b = final_state(straight), final_state(killed)
    assert a["global_step"] == b["global_step"] == steps
    for name, tensor in a["state_dict"].items():
        assert torch.isfinite(tensor).all()
        assert torch.equal(tensor, b["state_dict"][name]), name


def test_block_stats_are_logged_on_the_first_steps_and_every_n(tmp_path, text_file):
    lit = LitGPT(GPTConfig(n_layer=3, n_embd=16, block_size=16, vocab_size=64), block_stats_first=2,
                 block_stats_every=3)  # fmt: skip
    logged: list[tuple[int, str]] = []
    log = lit.log
    lit.log = lambda name, value, **kw: (logged.append((lit.global_step, name)), log(name, value, **kw))
    trainer = tiny_trainer(tmp_path, 5)
    trainer.fit(lit, tiny_data(text_file))
    steps = sorted({step for step, name in logged if name == "grad_norm/blocks.0"})
    assert steps == [0, 1, 3]
    for i in range(3):
        assert trainer.callback_metrics[f"grad_norm/blocks.{i}"] > 0
        assert trainer.callback_metrics[f"grad_norm/blocks.{i}.mlp.c_proj"] > 0
        assert 0 < trainer.callback_metrics[f"update_ratio/blocks.{i}"] < 1
    assert lit.weights_before is None


def test_grad_norms_at_init_give_one_float_per_block_and_leave_no_gradient():
    model = LitGPT(GPTConfig(n_layer=3, n_embd=16, block_size=16, vocab_size=64)).model
    batches = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(2)]
    norms = grad_norms_at_init(model, batches)
    assert set(norms) == {"blocks", "mlp.c_proj"}
    assert all(len(v) == 3 and all(x > 0 for x in v) for v in norms.values())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_splits_batches_agrees_on_skips_and_ends_equal(tmp_path, text_file):
    script = Path(__file__).parent / "ddp_fit.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), text_file],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sync_dist" not in done.stderr  # epoch-level validation logs are synced across ranks
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert rank0["global_step"] == rank1["global_step"] == 5
    assert len(rank0["batches"]) == len(rank1["batches"]) == 5
    assert all(a != b for a, b in zip(rank0["batches"], rank1["batches"], strict=True))  # different batches
    assert rank0["nonfinite_steps"] == rank1["nonfinite_steps"] == 1  # rank 1's NaN skipped on both
    for name, weight in rank0["weights"].items():
        assert torch.isfinite(weight).all()
        assert torch.equal(weight, rank1["weights"][name]), name
    assert rank0["val_loss"] == pytest.approx(rank1["val_loss"])
