"""What each view of the explore page shows, computed by the report function its command prints.

One source of numbers: every payload is the dict that ``blocklab COMMAND ... --json`` prints for the
same model, text and T (``shapes.describe``, ``flops.analyse``, ``params.describe``,
``bus.stream_report``, ``ablate.ablation_report``, ``depth.depth_report``), and carries that command
line, so the page can say which command prints it and a test can run it and compare.

The Block view runs ``shapes.describe`` on the meta device: the tensors have shapes and no data, so a
T of a million costs what a T of one does, and a slider can ask for any T (the numbers equal a CPU
run's). The first operation on the meta device takes seconds (torch imports its compiler stack for
it): ``Explorer.__init__`` does it, with the first view.
The model-wide views (bus, ablation) run the model once each, on first request, and are kept;
depth builds and times its own stacks, on request.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lab.analysis import ablate, bus, common, depth, flops, params, shapes
from lab.analysis.designs import DESIGNS, Design
from lab.config import GPT2_VOCAB_SIZE, PRESETS
from lab.errors import UserError
from lab.model import GPT, Block

BUS_TOKENS = 1024
"""``blocklab bus``'s default ``--tokens`` (capped at the model's context, as the command caps it)."""
ABLATE_TOKENS = 512
"""``blocklab ablate``'s default ``--tokens``."""
ABLATE_MODES = ["skip", "overwrite"]
"""``blocklab ablate``'s default ``--mode both``."""
T_MAX = 1 << 20
"""The largest T the Block view takes: past every design's context, and free on the meta device."""
DEPTH_DEFAULTS = {"stacks": depth.DEFAULT_STACKS, "baseline": "12x768", "new": 32, "repeats": 3}
"""``blocklab depth``'s defaults, the depth form's first values."""
CURVE_TS = [1 << k for k in range(18)]
"""T values of the attention-share curve (1 .. 131072, Llama 3.1's context), as ``blocklab flops
--T ... --no-count`` prints them."""


def command(*words: Any) -> str:
    return shlex.join(["blocklab", *map(str, words)])


class Explorer:
    """The model and text of one ``blocklab explore``, and its views' reports, each computed once."""

    def __init__(self, model: GPT, spec: str, text: Path | None = None):
        self.model, self.spec, self.text = model, spec, text
        cfg = dataclasses.replace(model.config, dropout=0.0)  # as blocklab shapes builds its Block
        self.design = Design.from_config(cfg, spec)
        with torch.device("meta"):
            self.block = Block(cfg).eval()
        if text is not None:
            text.open("rb").close()  # a missing or unreadable file fails now, not in a view
        self._cache: dict[Any, dict] = {}
        # lab.hooks.capture hooks the module it reads: one pass at a time through the model, the Block
        self._model_lock, self._block_lock = threading.Lock(), threading.Lock()
        self._depth_lock = threading.Lock()  # timings measured side by side would disturb each other
        self.block_view(cfg.block_size)  # the first view, and torch's meta kernels imported

    def _tokens(self, n: int) -> tuple[list[int], str]:
        """The first ``n`` tokens of the text and where they came from, as the commands read them
        (a ``UserError`` for a model without GPT-2's vocabulary)."""
        return common.text_tokens(argparse.Namespace(text=self.text, tokens=n), self.model)

    def _model_and_text_args(self) -> list[str]:
        return ["--model", self.spec] + (["--text", str(self.text)] if self.text is not None else [])

    def _once(self, key: Any, lock: threading.Lock, compute: Callable[[], dict]) -> dict:
        with lock:
            if key not in self._cache:
                self._cache[key] = compute()
            return self._cache[key]

    # --- the views -------------------------------------------------------------------------------

    def info(self) -> dict:
        cfg = self.model.config
        return {
            "model": self.spec,
            "config": dataclasses.asdict(cfg),
            "params": self.model.num_params(),
            "text": str(self.text) if self.text is not None else None,
            "T_max": T_MAX,
            "depth_defaults": DEPTH_DEFAULTS,
        }

    def shapes_command(self, T: int) -> str:
        """``blocklab shapes`` builds its Block from a preset and overrides: the gpt2 preset and every
        field in which the model differs from it."""
        cfg, gpt2 = dataclasses.asdict(self.model.config), dataclasses.asdict(PRESETS["gpt2"])
        overrides = []
        for name, value in cfg.items():
            if name == "dropout" or value == gpt2[name]:
                continue
            flag = "--" + name.replace("_", "-")
            overrides += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, value]
        return command("shapes", "--config", "gpt2", *overrides, "--T", T, "--json")

    def block_view(self, T: int) -> dict:
        """The Block's six tensors at T (``blocklab shapes``), the model's FLOPs per token at T and
        along ``CURVE_TS`` (``blocklab flops --no-count``: formula only)."""

        with self._block_lock, torch.device("meta"):  # no cache: on the meta device a T costs milliseconds
            report = shapes.describe(self.block, 1, T)
        return {
            "shapes": report,
            "flops": flops.analyse(self.design, [T], None),
            "curve": flops.analyse(self.design, CURVE_TS, None),
            "commands": {
                "shapes": self.shapes_command(T),
                "flops": command("flops", "--model", self.spec, "--T", T, "--no-count", "--json"),
                "curve": command("flops", "--model", self.spec, "--T", *CURVE_TS, "--no-count", "--json"),
            },
        }

    def params_view(self) -> dict:
        """Every preset design (``blocklab params --all``) and the model's own count (``--model``)."""
        yours = params.describe(Design.from_config(self.model.config, self.spec), self.model)
        return {
            "designs": params.compare(list(DESIGNS.values()))[0],
            "model": yours,
            "commands": {
                "designs": command("params", "--all", "--json"),
                "model": command("params", "--model", self.spec, "--json"),
            },
        }

    def bus_view(self) -> dict:
        def compute() -> dict:
            ids, text = self._tokens(BUS_TOKENS)
            report = {"model": self.spec, "text": text, **bus.stream_report(self.model, ids)}
            return {"report": report, "command": command("bus", *self._model_and_text_args(), "--json")}

        return self._once("bus", self._model_lock, compute)

    def ablate_view(self) -> dict:
        def compute() -> dict:
            ids, text = self._tokens(ABLATE_TOKENS)
            losses = ablate.ablation_report(self.model, ids, ABLATE_MODES)
            report = {"model": self.spec, "text": text, **losses}
            return {"report": report, "command": command("ablate", *self._model_and_text_args(), "--json")}

        return self._once("ablate", self._model_lock, compute)

    def depth_view(self, stacks: list[str], baseline: str, new: int, repeats: int) -> dict:
        """``blocklab depth`` with these options and its other defaults (it times: measured on request,
        kept per options)."""
        if baseline not in stacks:
            raise UserError(f"baseline {baseline} is not among the stacks {stacks}")
        for stack in stacks:
            depth.parse_stack(stack)  # a UserError naming a malformed one, before anything is built
        head_size, prompt, threads = 64, 16, torch.get_num_threads()

        def compute() -> dict:
            report = depth.depth_report(stacks, baseline, head_size, GPT2_VOCAB_SIZE, prompt, new, repeats)
            line = command("depth", "--stacks", *stacks, "--baseline", baseline, "--new", new,
                           "--repeats", repeats, "--threads", threads, "--json")  # fmt: skip
            return {"report": report, "command": line}

        return self._once(("depth", tuple(stacks), baseline, new, repeats), self._depth_lock, compute)
