"""Every YAML under configs/ goes through the real parser that reads it (`blocklab fit`'s for
configs/*.yaml, `blocklab stall`'s for configs/stall/*.yaml), so configs cannot drift."""

from pathlib import Path

import pytest

from lab.data import CharDataModule
from lab.errors import UserError
from lab.stall import cli as stall_cli
from lab.stall.cli import load_preset
from lab.train import TRAINER_DEFAULTS, LabCLI, LitGPT

ROOT = Path(__file__).parents[1] / "configs"
CONFIGS = sorted(ROOT.glob("*.yaml"))
PRESETS = sorted((ROOT / "stall").glob("*.yaml"))
BASES = ["preln.yaml", "postln.yaml", "postln_warmup.yaml"]  # full runs; the others are overlays


class ParseOnly(LabCLI):
    """The `blocklab fit` parser, without building the trainer (gpu.yaml asks for a GPU)."""

    def instantiate_classes(self) -> None:
        pass


def parse(*configs: Path, flags: tuple[str, ...] = ()) -> object:
    args = [arg for path in configs for arg in ("--config", str(path))]
    cli = ParseOnly(
        LitGPT,
        CharDataModule,
        run=False,
        args=[*args, *flags],
        trainer_defaults=TRAINER_DEFAULTS,
        auto_configure_optimizers=False,
    )
    return cli.config


def test_the_experiment_configs_exist():
    assert set(BASES) <= {path.name for path in CONFIGS}
    assert {"cpu.yaml", "gpu.yaml"} <= {path.name for path in PRESETS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_alone_and_on_top_of_each_base(path):
    parse(path)
    for base in BASES:
        parse(ROOT / base, path)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_stall_preset_parses_alone_and_as_a_config(path):
    preset = load_preset(path.stem)
    assert stall_cli.parse(["--config", str(path)])[0] == preset
    assert stall_cli.parse(["--preset", path.stem, "--config", str(path)])[0] == preset


def test_unknown_key_in_a_config_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  config:\n    n_layers: 6\n")
    with pytest.raises(SystemExit):
        parse(bad)
    bad.write_text("n_layers: 6\n")
    with pytest.raises(UserError, match="n_layers"):
        stall_cli.parse(["--config", str(bad)])


@pytest.mark.parametrize("name", BASES)
def test_experiment_configs_are_the_stall_cpu_preset(name):
    config = parse(ROOT / name)
    preset = load_preset("cpu")
    model = config.model
    assert config.stall_preset == "cpu"
    assert (model.config.n_layer, model.config.n_head, model.config.n_embd, model.config.block_size) == (
        preset.n_layer,
        preset.n_head,
        preset.n_embd,
        preset.seq_len,
    )
    assert (config.data.seq_len, config.data.batch_size, config.data.val_batches) == (
        preset.seq_len,
        preset.batch_size,
        preset.val_batches,
    )
    assert (model.lr, tuple(model.betas), model.weight_decay) == (
        preset.lr,
        preset.betas,
        preset.weight_decay,
    )
    assert config.trainer.gradient_clip_val == preset.grad_clip
    assert config.trainer.max_steps == preset.steps
    assert config.trainer.precision == preset.precision
    assert config.seed_everything == config.data.seed == preset.seeds[0]
    assert model.config.norm == ("pre" if name == "preln.yaml" else "post")
    assert model.warmup_steps == (preset.warmup if name == "postln_warmup.yaml" else 0)
    assert config.trainer.logger.init_args.version == name.removesuffix(".yaml")


def test_the_gpu_overlay_is_the_stall_gpu_preset_and_configs_and_flags_override_a_preset():
    gpu = load_preset("gpu")
    config = parse(ROOT / "postln_warmup.yaml", ROOT / "gpu.yaml")
    assert (config.model.config.n_embd, config.model.config.block_size, config.data.batch_size) == (
        gpu.n_embd,
        gpu.seq_len,
        gpu.batch_size,
    )
    assert (config.trainer.precision, config.model.warmup_steps) == (gpu.precision, gpu.warmup)
    assert (config.trainer.max_steps, config.data.val_batches, config.model.config.norm) == (5000, 16, "post")
    tiny = parse(ROOT / "preln.yaml", ROOT / "tiny.yaml", flags=("--trainer.max_steps", "7"))
    assert (tiny.model.config.n_layer, tiny.data.seq_len, tiny.trainer.max_steps) == (2, 32, 7)
    assert parse(ROOT / "tiny.yaml", flags=("--stall_preset", "gpu")).trainer.precision == gpu.precision
