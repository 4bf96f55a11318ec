"""Load weights into ``lab.model.GPT`` from every place GPT-2 weights live, and save our own.

    model = load_model("builtin")            # the embedded model: shipped in lab/assets, or retrained
    model = load_model("gpt2-random")        # GPT-2 small shapes, seeded random weights (latency work)
    model = load_model("openai-community/gpt2")  # Hugging Face hub id: cached copy, else download
    model = load_model("path/to/hf_dir")     # config.json + model.safetensors | pytorch_model.bin
    model = load_model("path/to/ckpt.pt")    # a nanoGPT checkpoint (model_args + model)
    model = load_model("path/to/model_dir")  # our format: blocklab.json + model.safetensors (save_model)
    model = load_model("builtin", "int4")    # weights in bfloat16 | float16, or weight-only int8 | int4

Every source is mapped to our parameter names, then checked key by key and shape by shape against
the model its config describes; a mismatch names the key. Layouts: our ``Linear`` stores [in, out],
like Hugging Face's Conv1D (no transpose); nanoGPT's ``nn.Linear`` stores [out, in] (transposed here).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lab import tokens
from lab.block_kernel import use_block_kernels, uses_block_kernels
from lab.config import GPTConfig
from lab.errors import UserError
from lab.exit_probe import FILE as EXIT_PROBE_FILE
from lab.exit_probe import load_exit_probe, save_exit_probe
from lab.float_kernels import use_float_kernels, uses_float_kernels
from lab.huge_pages import hold_in_huge_pages
from lab.model import GPT
from lab.quantize import QUANTIZED_DTYPES, WEIGHT_DTYPES, QuantizedLinear, quantize

logger = logging.getLogger(__name__)

FORMAT_FILE = "blocklab.json"
WEIGHTS_FILE = "model.safetensors"
GPT2_IDS = "vocabulary.gpt2_ids"
"""In a compact-vocabulary model's weights file: [V_seen] the GPT-2 id of each row it trained."""
RANDOM_SEED = 1234
"""Seed of ``gpt2-random``: the same random weights in every process."""


def cache_root() -> Path:
    """Where blocklab keeps what it creates: ``$BLOCKLAB_CACHE``, else ``~/.cache/blocklab``."""
    return Path(os.environ.get("BLOCKLAB_CACHE") or Path.home() / ".cache" / "blocklab")


BUILTIN_MODELS = ("builtin", "builtin-early-exit")
"""The embedded models (``blocklab builtin --recipe early-exit`` makes the second), each in its directory."""

SHIPPED_DIR = Path(__file__).parent / "assets"
"""Where the package carries the embedded models as ``blocklab builtin`` made them."""


def builtin_dir(name: str = "builtin") -> Path:
    """Where ``blocklab builtin`` writes an embedded model (``BUILTIN_MODELS``): the user's cache."""
    return cache_root() / name


def shipped_dir(name: str = "builtin") -> Path:
    """The embedded model ``name`` as the package ships it."""
    return SHIPPED_DIR / name


def builtin_source(name: str = "builtin") -> Path:
    """The directory ``--model NAME`` loads: the user's retrained copy if there is one, else the shipped
    one."""
    retrained = builtin_dir(name)
    if (retrained / FORMAT_FILE).exists():
        _say_retrained(retrained)
        return retrained
    return shipped_dir(name)


@functools.cache
def _say_retrained(directory: Path) -> None:
    logger.warning(
        "using the %s model retrained in %s (remove that directory, or run `blocklab builtin --reset`, "
        "to use the shipped one)",
        directory.name,
        directory,
    )


# ---------------------------------------------------------------------------------------------------
# Our format


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_model(
    model: GPT,
    directory: str | Path,
    *,
    metadata: dict[str, Any] | None = None,
    vocabulary: tuple[torch.Tensor, float] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model`` as ``blocklab.json`` (config, metadata, the files' sha256) and
    ``model.safetensors``, and its exit probe (lab.exit_probe) as ``exit_probe.safetensors`` if it has
    one; returns the dir. ``dtype``: store the floating-point tensors in it.

    ``vocabulary`` (gpt2_ids [V_seen], unseen_logit): ``model`` is a compact-vocabulary model whose row
    i is GPT-2 token ``gpt2_ids[i]`` (``lab.token_data``); only its rows are stored, and loading widens
    it to GPT-2's vocabulary, every other token a zero row with the fixed logit ``unseen_logit``.

    Written through temporary names then renamed, so a crash never leaves a half-written model behind.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor.detach().to(dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)
        for name, tensor in model.state_dict().items()
    }
    description = {"format": "blocklab", "config": dataclasses.asdict(model.config)}
    if vocabulary is not None:
        gpt2_ids, unseen_logit = vocabulary
        state[GPT2_IDS] = gpt2_ids.to(torch.int32)
        description["vocabulary"] = {"size": tokens.VOCAB_SIZE, "unseen_logit": unseen_logit}
    state = {name: tensor.contiguous().cpu() for name, tensor in state.items()}
    weights_tmp, format_tmp = directory / (WEIGHTS_FILE + ".tmp"), directory / (FORMAT_FILE + ".tmp")
    save_file(state, str(weights_tmp))
    hashes = {WEIGHTS_FILE: sha256(weights_tmp)}
    if model.exit_probe is not None:
        hashes[EXIT_PROBE_FILE] = sha256(save_exit_probe(model.exit_probe, directory))
    else:  # another model's probe must not stay beside these weights
        (directory / EXIT_PROBE_FILE).unlink(missing_ok=True)
    description |= {"sha256": hashes, "metadata": metadata or {}}
    format_tmp.write_text(json.dumps(description, indent=2) + "\n")
    weights_tmp.replace(directory / WEIGHTS_FILE)
    format_tmp.replace(directory / FORMAT_FILE)  # last: its presence marks a complete model
    return directory


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """The metadata ``save_model`` stored with a model (e.g. how the builtin model was trained)."""
    return json.loads((Path(directory) / FORMAT_FILE).read_text())["metadata"]


def check_hashes(directory: Path, hashes: dict[str, str]) -> None:
    """UserError naming any file of ``directory`` whose sha256 is not the one recorded for it."""
    for name, expected in hashes.items():
        path = directory / name
        if not path.exists() or sha256(path) != expected:
            state = "missing" if not path.exists() else "damaged (its sha256 differs from blocklab.json's)"
            raise UserError(f"{path}: {state}; reinstall blocklab, or make the model again")


def widen_state(
    cfg: GPTConfig, state: dict[str, torch.Tensor], gpt2_ids: torch.Tensor, unseen_logit: float
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """A compact-vocabulary model's config and state as a GPT-2-vocabulary model's: row ``gpt2_ids[i]``
    gets compact row i, and every never-seen token a zero row and a ``logit_bias`` of ``unseen_logit``,
    so its logit is exactly that whatever the input, in any precision (a row of the table alone could
    give a constant logit only through a cancellation that rounding breaks)."""
    compact = state["wte.weight"]  # [V_seen, D]
    table = compact.new_zeros(tokens.VOCAB_SIZE, cfg.n_embd)  # [50257, D]
    table[gpt2_ids.long()] = compact
    bias = torch.full((tokens.VOCAB_SIZE,), unseen_logit, dtype=compact.dtype)  # [50257]
    bias[gpt2_ids.long()] = 0.0
    wide = dataclasses.replace(cfg, vocab_size=tokens.VOCAB_SIZE, dropout=0.0, logit_bias=True)
    return wide, {**state, "wte.weight": table, "logit_bias": bias}


def _load_ours(directory: Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    description = json.loads((directory / FORMAT_FILE).read_text())
    if description.get("format") != "blocklab":
        raise UserError(f"{directory / FORMAT_FILE}: not a blocklab model description")
    check_hashes(directory, description.get("sha256", {}))
    cfg, state = GPTConfig(**description["config"]), load_file(str(directory / WEIGHTS_FILE))
    if "vocabulary" in description:
        gpt2_ids = state.pop(GPT2_IDS)
        state = {name: t.float() if t.is_floating_point() else t for name, t in state.items()}  # as trained
        cfg, state = widen_state(cfg, state, gpt2_ids, description["vocabulary"]["unseen_logit"])
    return cfg, state


# ---------------------------------------------------------------------------------------------------
# Hugging Face format (GPT2LMHeadModel / GPT2Model): config.json + safetensors or pytorch_model.bin

# Hugging Face name (after dropping a leading "transformer.") -> ours. Conv1D is [in, out] like ours.
_HF_BLOCK = re.compile(r"^h\.(\d+)\.(.+)$")
_HF_IGNORED = re.compile(r"^(lm_head\.weight|h\.\d+\.attn\.(bias|masked_bias))$")  # tied copy, masks


def _hf_config(config: dict[str, Any]) -> GPTConfig:
    if config.get("model_type", "gpt2") != "gpt2":
        raise UserError(f"config.json: model_type {config['model_type']!r} is not gpt2")
    activation = config.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"config.json: activation_function {activation!r}; our MLP is GELU (tanh)")
    n_inner = config.get("n_inner")
    if n_inner not in (None, 4 * config["n_embd"]):
        raise UserError(f"config.json: n_inner {n_inner}; our MLP is 4 * n_embd = {4 * config['n_embd']}")
    for flag, expected in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
        ("tie_word_embeddings", True),
    ):
        if config.get(flag, expected) != expected:
            raise UserError(f"config.json: {flag}={config[flag]} is not supported (need {expected})")
    return GPTConfig(
        n_layer=config["n_layer"],
        n_head=config["n_head"],
        n_embd=config["n_embd"],
        vocab_size=config["vocab_size"],
        block_size=config["n_positions"],
        layer_norm_eps=config.get("layer_norm_epsilon", 1e-5),
    )


def _from_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ours = {}
    for name, tensor in state.items():
        name = name.removeprefix("transformer.")
        if _HF_IGNORED.match(name):
            continue
        block = _HF_BLOCK.match(name)
        ours[f"blocks.{block[1]}.{block[2]}" if block else name] = tensor
    return ours


def _read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").exists():
        return load_file(str(directory / "model.safetensors"))
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(str(directory / shard)).items()}
    if (directory / "pytorch_model.bin").exists():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"{directory}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def _load_hf_dir(directory: Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    cfg = _hf_config(json.loads((directory / "config.json").read_text()))
    return cfg, _from_hf_names(_read_hf_weights(directory))


def save_hf_dir(model: GPT, directory: str | Path) -> Path:
    """Write a plain GPT-2 ``model`` as a Hugging Face GPT2LMHeadModel directory with GPT-2's tokenizer
    (``lab.tokens.write_hf_tokenizer``), for other engines' converters (llama.cpp's
    convert_hf_to_gguf.py); ``load_model`` reads it back. Only what GPT-2's config can say is kept:
    pre-LN LayerNorm, biases, no logit bias or quantization."""
    cfg = model.config
    plain = (cfg.norm, cfg.norm_type, cfg.bias, cfg.logit_bias) == ("pre", "layer", True, False)
    if not plain or isinstance(model.read_out, QuantizedLinear):
        raise UserError("save_hf_dir: only a plain GPT-2 (pre-LN LayerNorm, biases, fp weights) converts")
    directory = tokens.write_hf_tokenizer(directory)
    config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd, "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "layer_norm_epsilon": cfg.layer_norm_eps,
        "bos_token_id": tokens.EOT, "eos_token_id": tokens.EOT, "tie_word_embeddings": True,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    state = {
        "transformer." + name.replace("blocks.", "h.", 1): tensor.detach().float().contiguous().cpu()
        for name, tensor in model.state_dict().items()
    }
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _download_hf(repo_id: str) -> Path:
    """A local snapshot of a hub repo's config and weights: the cached one, else downloaded."""
    from huggingface_hub import snapshot_download

    safetensors = ["config.json", "*.safetensors", "model.safetensors.index.json"]
    pickled = ["config.json", "pytorch_model.bin"]  # old repos have only this
    for local_only in (True, False):  # the cache first: no network round trip when it is there
        try:
            path = Path(snapshot_download(repo_id, allow_patterns=safetensors, local_files_only=local_only))
            if not any(path.glob("*.safetensors")):
                path = Path(snapshot_download(repo_id, allow_patterns=pickled, local_files_only=local_only))
            return path
        except Exception as error:  # huggingface_hub raises many types for "not cached" / "no network"
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
    raise UserError(
        f"model {repo_id!r}: not a local path, not in the Hugging Face cache, and the hub could not be "
        f"reached or has no such repo ({reason}); pass a local directory or checkpoint, or use "
        "'builtin' / 'gpt2-random'"
    )


# ---------------------------------------------------------------------------------------------------
# nanoGPT checkpoints (ckpt.pt from Karpathy's nanoGPT train.py)

# nanoGPT's nn.Linear weights are [out, in]; ours are [in, out].
_NANOGPT_TRANSPOSED = re.compile(r"^blocks\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


def _load_nanogpt(checkpoint: dict[str, Any]) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    args = checkpoint["model_args"]
    cfg = GPTConfig(
        n_layer=args["n_layer"],
        n_head=args["n_head"],
        n_embd=args["n_embd"],
        vocab_size=args["vocab_size"],
        block_size=args["block_size"],
        bias=args.get("bias", True),
    )
    state = {}
    for name, tensor in checkpoint["model"].items():
        name = name.removeprefix("_orig_mod.")  # torch.compile'd models save with this prefix
        name = name.removeprefix("transformer.")
        if _HF_IGNORED.match(name):  # same names as GPT-2's: lm_head is the tied table, attn.bias a mask
            continue
        block = _HF_BLOCK.match(name)
        name = f"blocks.{block[1]}.{block[2]}" if block else name
        state[name] = tensor.t() if _NANOGPT_TRANSPOSED.match(name) else tensor
    return cfg, state


# ---------------------------------------------------------------------------------------------------
# blocklab Lightning checkpoints (lab.train.LitGPT): hyper_parameters hold the config, the GPT is `model.`


def _load_lightning(checkpoint: dict[str, Any]) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    hparams = checkpoint.get("hyper_parameters", {})
    config = hparams.get("config") or hparams.get("model_config")
    if config is None:
        raise UserError(
            f"Lightning checkpoint: no model config in hyper_parameters (keys: {sorted(hparams)})"
        )
    cfg = config if isinstance(config, GPTConfig) else GPTConfig(**dict(config))
    prefix = "model."
    state = {k.removeprefix(prefix): v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    return cfg, state


def _load_checkpoint_file(path: Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    # weights_only=False: nanoGPT and Lightning checkpoints pickle plain config objects; only load
    # checkpoints you trust.
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as error:  # torch's for "not a checkpoint"
        raise UserError(f"{path}: not a checkpoint torch can read ({error})") from None
    if not isinstance(checkpoint, dict):
        raise UserError(f"{path}: a {type(checkpoint).__name__}, not a checkpoint dictionary")
    if "model_args" in checkpoint and "model" in checkpoint:
        return _load_nanogpt(checkpoint)
    if "state_dict" in checkpoint and "pytorch-lightning_version" in checkpoint:
        return _load_lightning(checkpoint)
    raise UserError(
        f"{path}: neither a nanoGPT checkpoint (model_args + model) nor a Lightning checkpoint "
        f"(state_dict); top-level keys: {sorted(checkpoint)[:10]}"
    )


# ---------------------------------------------------------------------------------------------------
# Building the model


def check_state(model: GPT, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError naming every missing, unexpected or wrongly shaped key of ``state``."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = [
        f"{name}: {tuple(state[name].shape)} in {source}, model wants {shape}"
        for name, shape in expected.items()
        if name in state and tuple(state[name].shape) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if wrong_shape:
        problems.append("wrong shapes: " + "; ".join(wrong_shape))
    if problems:
        raise UserError(f"{source}: weights do not fit the model: " + " | ".join(problems))


def build_model(
    cfg: GPTConfig,
    state: dict[str, torch.Tensor],
    source: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> GPT:
    """A GPT of ``cfg`` holding ``state`` (checked key by key first), in eval mode."""
    with torch.device("meta"):
        model = GPT(cfg).to(dtype=dtype)  # no memory and no random init yet
    check_state(model, state, source)
    model.to_empty(device=device)  # uninitialised, in the model's own memory layout (see lab.model.Linear)
    with torch.no_grad():
        model.load_state_dict(state, strict=True)  # copies the values in, converting the dtype
    model.compact_read_out()  # a table of mostly zero rows: the read-out multiplies the others
    return model.eval()


def random_model(
    name: str = "gpt2", *, seed: int = RANDOM_SEED, dtype=torch.float32, device="cpu", **overrides
) -> GPT:
    """A preset's shapes with GPT-2's random initialisation, the same for the same seed."""
    cfg = GPTConfig.from_name(name, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
    return model.to(device=device, dtype=dtype).eval()


def locate(spec: str) -> Path | None:
    """The directory or checkpoint file that ``spec`` names (a hub repo is fetched into the cache
    first); None for ``gpt2-random``. Raises ``UserError`` or ``FileNotFoundError`` saying what to do
    when there is none, so a server can check its model before it starts workers."""
    if spec == "gpt2-random":
        return None
    if spec in BUILTIN_MODELS:
        directory = builtin_source(spec)
        if not (directory / FORMAT_FILE).exists():
            command = "blocklab builtin" + (" --recipe early-exit" if spec != "builtin" else "")
            raise FileNotFoundError(
                f"the {spec} model is neither shipped ({directory} is empty: reinstall blocklab) nor "
                f"made here: run `{command}`, or set BLOCKLAB_CACHE to where it lives"
            )
        return directory
    path = Path(spec).expanduser()
    if path.is_file() or (path / FORMAT_FILE).exists() or (path / "config.json").exists():
        return path
    if path.exists():
        raise UserError(f"{path}: a directory without blocklab.json or config.json")
    if spec.count("/") <= 1 and not spec.startswith((".", "/", "~")):
        return _download_hf(spec)
    raise FileNotFoundError(f"{spec}: no such file or directory")


def load_model(
    spec: str,
    dtype: str | torch.dtype = "float32",
    *,
    device: torch.device | str = "cpu",
    attention: str | None = None,
    kernels: bool = True,
) -> GPT:
    """A GPT in eval mode from a spec (see the module docstring), the one loader of every command.

    ``dtype``: one of ``lab.quantize.WEIGHT_DTYPES`` (``float32``, ``bfloat16``, ``float16``, or
    ``int8`` / ``int4``: weight-only quantized; ``w8a8`` / ``w4a8``: int8 or int4 weights times int8
    activations; CPU only), or a torch floating dtype.
    ``attention``: 'eager' | 'sdpa' override. The model's tuned lens, where one was fitted to it
    (``lab.lens.home``), comes with it as ``model.tuned_lens``.
    ``kernels``: on a CPU where lab.intmm builds, float32 and bf16 weights decode through its
    products (``lab.float_kernels``), and every model's decode steps through its blocks in one call
    each, or their attention alone (``lab.block_kernel``): the same parameters; training and prompts
    still take torch's.
    On the CPU the weights lie in transparent huge pages where Linux gives them (``lab.huge_pages``).
    False keeps torch's products and attention throughout (a baseline; int8 and int4 on torch's
    weight-only kernels, ``lab.quantize``).
    """
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if name not in WEIGHT_DTYPES:
        raise UserError(f"dtype: one of {', '.join(WEIGHT_DTYPES)}; got {dtype!r}")
    quantized = name in QUANTIZED_DTYPES
    if quantized and torch.device(device).type != "cpu":
        raise UserError(f"dtype {name} runs on the CPU, not {device}")
    # quantized weights are made from bf16 ones, the activations' dtype
    model = _load(spec, torch.bfloat16 if quantized else getattr(torch, name), device, attention)
    model = quantize(model, name, kernels) if quantized else model
    if kernels and not quantized and uses_float_kernels(model.wte.weight.dtype, device):
        use_float_kernels(model)
    if kernels and uses_block_kernels(device):
        use_block_kernels(model)
    from lab.lens.home import attach_tuned_lens  # here: lab.lens.home finds a lens by lab.weights' paths

    attach_tuned_lens(spec, model)  # a tuned lens fitted to it, for lens=tuned block sets (or None)
    if torch.device(device).type == "cpu":
        hold_in_huge_pages(model)  # a step streams every weight: 2 MiB pages, not a page walk per 4 KiB
    return model


def _load(spec: str, dtype: torch.dtype, device: torch.device | str, attention: str | None) -> GPT:
    overrides = {} if attention is None else {"attention": attention}
    if spec == "gpt2-random":
        return random_model("gpt2", dtype=dtype, device=device, **overrides)
    path = locate(spec)
    ours = (path / FORMAT_FILE).exists()  # our format: the directory may hold an exit probe too
    if ours:
        cfg, state = _load_ours(path)
    elif path.is_dir():
        cfg, state = _load_hf_dir(path)
    else:
        cfg, state = _load_checkpoint_file(path)
    cfg = dataclasses.replace(cfg, dropout=0.0, **overrides)
    model = build_model(cfg, state, spec, dtype=dtype, device=device)
    if ours and (probe := load_exit_probe(path, model)) is not None:
        model.exit_probe = probe.to(device)
    return model
