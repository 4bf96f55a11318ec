"""Every YAML under configs/ goes through the real `blocklab fit` parser, so configs cannot drift."""

from pathlib import Path

import pytest

from lab.data import CharDataModule
from lab.stall import PRESETS
from lab.train import TRAINER_DEFAULTS, LabCLI, LitGPT

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
BASES = ["preln.yaml", "postln.yaml", "postln_warmup.yaml"]  # full runs; the others are overlays


class ParseOnly(LabCLI):
    """The `blocklab fit` parser, without building the trainer (gpu.yaml asks for a GPU)."""

    def instantiate_classes(self) -> None:
        pass


def parse(*configs: Path) -> object:
    args = [arg for path in configs for arg in ("--config", str(path))]
    cli = ParseOnly(
        LitGPT,
        CharDataModule,
        run=False,
        args=args,
        trainer_defaults=TRAINER_DEFAULTS,
        auto_configure_optimizers=False,
    )
    return cli.config


def test_the_experiment_configs_exist():
    assert set(BASES) <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_alone_and_on_top_of_each_base(path):
    parse(path)
    for base in BASES:
        parse(path.parent / base, path)


def test_unknown_key_in_a_config_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  config:\n    n_layers: 6\n")
    with pytest.raises(SystemExit):
        parse(bad)


@pytest.mark.parametrize("name", BASES)
def test_experiment_configs_are_the_stall_cpu_preset(name):
    config = parse(CONFIGS[0].parent / name)
    preset = PRESETS["cpu"]
    model = config.model
    assert (model.config.n_layer, model.config.n_head, model.config.n_embd) == (
        preset.n_layer,
        preset.n_head,
        preset.n_embd,
    )
    assert (config.data.seq_len, config.data.batch_size) == (preset.seq_len, preset.batch_size)
    assert (model.lr, tuple(model.betas), model.weight_decay) == (
        preset.lr,
        preset.betas,
        preset.weight_decay,
    )
    assert config.trainer.gradient_clip_val == preset.grad_clip
    assert config.trainer.max_steps == preset.steps
    assert model.config.norm == ("pre" if name == "preln.yaml" else "post")
    assert model.warmup_steps == (preset.warmup if name == "postln_warmup.yaml" else 0)
    assert config.trainer.logger.init_args.version == name.removesuffix(".yaml")
