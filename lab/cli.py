"""The ``blocklab`` command: one entry point, a subcommand per job.

Each subcommand lives in its own module with a ``main(argv)``; modules are imported only when their
command runs, so ``blocklab --help`` is instant and the library does not load the server's stack.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    # the training lab
    "fit": ("lab.train", "train one model from a LightningCLI YAML config"),
    "validate": ("lab.train", "evaluate a checkpoint on the validation split"),
    "stall": ("lab.stall", "reproduce the post-LN warmup stall: pre-LN vs post-LN, with/without warmup"),
    # inference
    "builtin": ("lab.builtin", "train (once) the embedded GPT-2-shaped default model into the cache dir"),
    "generate": ("lab.generate", "generate text from a model under a block set"),
    "score": ("lab.generate", "mean next-token loss of a text under a block set"),
    "serve": ("serve.app", "serve a model over HTTP with a block set chosen per request"),
    "traffic": ("serve.traffic", "send your traffic to a server under several block sets: latency vs loss"),
    # measurements
    "shapes": ("lab.analysis.shapes", "the six tensors of one Block, with shapes and parameters"),
    "params": ("lab.analysis.params", "parameters by component, with formulas"),
    "flops": ("lab.analysis.flops", "forward FLOPs per token, analytic and counted"),
    "bus": ("lab.analysis.bus", "residual-stream norms and each stage's write along the stack"),
    "ablate": ("lab.analysis.ablate", "loss with each block skipped or overwriting the stream"),
    "timing": ("lab.analysis.timing", "attention's share of a Block's wall time"),
    "depth": ("lab.analysis.depth", "batch-1 latency of equal-parameter stacks of different depth"),
    "cost": ("lab.analysis.cost", "training cost (6ND) in FLOPs, hours and MFU"),
    "plan": ("lab.plan", "which blocks to drop: every method's choice measured on your text, with latency"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: blocklab COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "blocklab COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"blocklab: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main([name, *rest]) or 0


if __name__ == "__main__":
    sys.exit(main())
