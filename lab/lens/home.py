"""Where a model's tuned lens is kept: beside its weights, except where those belong to someone else.

    lens_home("builtin")            # the user's cache dir (lab.weights.builtin_dir), never lab/assets
    lens_home("path/to/model_dir")  # that directory
    lens_home("path/to/ckpt.pt")    # the checkpoint's directory
    lens_home("openai-community/gpt2")  # $BLOCKLAB_CACHE/hub/openai-community--gpt2, not the hub's cache
    find_tuned_lens("builtin", model)   # the first lens of lens_sources() fitted to this model
    attach_tuned_lens("builtin", model)  # model.tuned_lens: what lens=tuned reads through (load_model)

The shipped builtin models live inside the package (lab/assets), which may be read-only and is
replaced by every install: a lens fitted to one is written to ``builtin_dir(name)``, the directory a
retrained copy would live in. Both may then share that directory (a lens fitted to the shipped model,
then the model retrained there), so a lens records the fingerprint of the weights it was fitted to
(``translator.model_fingerprint``) and is only ever applied to those.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lab.errors import UserError
from lab.lens.translator import TunedLens, load_tuned_lens
from lab.model import GPT
from lab.weights import BUILTIN_MODELS, SHIPPED_DIR, builtin_dir, cache_root, shipped_dir

logger = logging.getLogger(__name__)


def lens_home(spec: str) -> Path:
    """The directory ``blocklab lens fit --model SPEC`` writes the lens to (without ``--out``)."""
    if spec in BUILTIN_MODELS:
        return builtin_dir(spec)
    if spec == "gpt2-random":
        return cache_root() / spec
    path = Path(spec).expanduser()
    if path.resolve().is_relative_to(SHIPPED_DIR.resolve()):  # a shipped model named by its path
        return builtin_dir(path.resolve().relative_to(SHIPPED_DIR.resolve()).parts[0])
    if not path.exists():
        return cache_root() / "hub" / spec.replace("/", "--")  # a hub id (lab.weights.locate)
    return path if path.is_dir() else path.parent  # a checkpoint file: its directory


def lens_sources(spec: str) -> list[Path]:
    """Where a lens of ``spec`` is looked for, in order: its home, then beside the weights when
    those are elsewhere (the package's copy of a shipped model, where a release may ship one)."""
    home, path = lens_home(spec), Path(spec).expanduser()
    beside = shipped_dir(spec) if spec in BUILTIN_MODELS else path
    return [home] + ([beside] if beside != home and (spec in BUILTIN_MODELS or path.is_dir()) else [])


def first_fitted(sources: list[Path], model: GPT) -> tuple[TunedLens | None, Path | None, UserError | None]:
    """The first lens in ``sources`` fitted to ``model`` and its directory; else None, None and why
    the first lens found was refused (another model's), or None when there was none."""
    refused = None
    for source in sources:
        try:
            lens = load_tuned_lens(source, model)
        except UserError as error:  # another model's lens: a later source may hold this one's
            refused = refused or error
            continue
        if lens is not None:
            return lens, source, None
    return None, None, refused


def find_tuned_lens(spec: str, model: GPT, directory: Path | None = None) -> tuple[TunedLens, Path]:
    """The lens of ``model`` (loaded from ``spec``) and the directory it came from: ``directory``
    alone when given, else the first of ``lens_sources(spec)`` that holds one fitted to this model.
    UserError saying how to fit one when there is none."""
    sources = [directory] if directory is not None else lens_sources(spec)
    lens, source, refused = first_fitted(sources, model)
    if lens is not None:
        return lens, source
    if refused is not None:
        raise refused
    looked = ", ".join(str(source) for source in sources)
    raise UserError(f"no tuned lens for {spec} (looked in {looked}): {how_to_fit(spec)}")


def how_to_fit(spec: str) -> str:
    """What to do when ``spec`` has no tuned lens, for an error to say."""
    return f"fit one with `blocklab lens fit --model {spec}`"


def attach_tuned_lens(spec: str, model: GPT) -> Path | None:
    """Set ``model.tuned_lens`` (what ``lens=tuned`` block sets read through) to the lens of ``spec``
    fitted to this model, on the model's device in its activations' dtype, or to None when there is
    none; the directory it came from. A lens fitted to other weights is left out, with a warning."""
    lens, source, refused = first_fitted(lens_sources(spec), model)
    if refused is not None:
        logger.warning("tuned lens not loaded: %s", refused)
    weight = model.wte.weight
    model.tuned_lens = None if lens is None else lens.to(weight.device, weight.dtype)
    return source
