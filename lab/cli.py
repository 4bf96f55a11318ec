"""The ``blocklab`` command: one entry point, a subcommand per job.

Each subcommand lives in its own module with a ``main(argv)``; modules are imported only when their
command runs, so ``blocklab --help`` is instant and the library does not load the server's stack.

Errors the user can fix (``lab.errors.UserError``, a path that is missing, a directory or not
readable, ``SystemExit("message")``) end as one line, ``blocklab COMMAND: message``, and exit status
2, like argparse's own; every other exception is a bug and keeps its traceback.

Before a command's module is imported (and torch with it), OpenMP is told to wait without spinning
(``lab.threads``): torch's threads would otherwise keep busy the cores that other processes need.
"""

from __future__ import annotations

import importlib
import logging
import os
import select
import sys
import warnings

from lab.errors import UserError
from lab.threads import yield_while_waiting

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    # the training lab
    "fit": ("lab.train", "train one model from a LightningCLI YAML config"),
    "validate": ("lab.train", "evaluate a checkpoint on the validation split"),
    "stall": ("lab.stall.cli", "reproduce the post-LN warmup stall: pre-LN vs post-LN, with/without warmup"),
    # inference
    "builtin": ("lab.builtin", "retrain the shipped default model (GPT-2-shaped, small) from its recipe"),
    "generate": ("lab.generate", "generate text from a model under a block set"),
    "score": ("lab.generate", "mean next-token loss of a text under a block set"),
    "serve": ("serve.app", "serve a model over HTTP with a block set chosen per request"),
    "traffic": ("serve.traffic", "send your traffic to a server under several block sets: latency vs loss"),
    "tokenizer": (
        "lab.tokens",
        "write GPT-2's tokenizer as a Hugging Face directory (aiperf, lm-eval), offline",
    ),
    # measurements
    "shapes": ("lab.analysis.shapes", "the six tensors of one Block, with shapes and parameters"),
    "params": ("lab.analysis.params", "parameters by component, with formulas"),
    "flops": ("lab.analysis.flops", "forward FLOPs per token, analytic and counted"),
    "bus": ("lab.analysis.bus", "residual-stream norms and each stage's write along the stack"),
    "ablate": ("lab.analysis.ablate", "loss with each block skipped or overwriting the stream"),
    "timing": ("lab.analysis.timing", "attention's share of a Block's wall time"),
    "depth": ("lab.analysis.depth", "batch-1 latency of equal-parameter stacks of different depth"),
    "cost": ("lab.analysis.cost", "training cost (6ND) in FLOPs, hours and MFU"),
    "lens": ("lab.lens.cli", "fit a tuned lens (a translator per block for early exit) and report its exits"),
    "plan": ("lab.plan", "which blocks to drop: every method's choice measured on your text, with latency"),
    "explore": ("lab.explore.app", "the Block, parameters, bus, ablation and frontier as one local page"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: blocklab COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "blocklab COMMAND --help shows a command's options."]
    return "\n".join(lines)


class _DropMessages(logging.Filter):
    """Drops a logger's records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


# logger -> what of it nobody running blocklab can act on
_NOISE = {
    # Lightning advertises its cloud logger on every Trainer
    "lightning.pytorch.utilities.rank_zero": _DropMessages("💡 Tip: For seamless cloud logging"),
    # every checkpoint of ours is written by our own Trainer settings: the default is the one we want
    "lightning.pytorch.trainer.connectors.checkpoint_connector": _DropMessages("`weights_only` was not set"),
}


def _quiet_known_noise() -> None:
    """Silence what our dependencies print that a user of blocklab cannot act on, one message of one
    library each, so any other warning still shows. Idempotent: a logging filter or a warnings filter
    added twice is kept once."""
    for logger, drop in _NOISE.items():
        logging.getLogger(logger).addFilter(drop)
    # torch deprecates a class that Lightning's own code still tests against (not ours)
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )


def _output_reader_left() -> bool:
    """Whether standard output is a pipe whose reader has gone (`blocklab shapes | head`): then the
    command just stops, without a traceback. Linux polls such a pipe as an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (AttributeError, ValueError, OSError):  # no poll, or no real file behind stdout
        return False
    return any(events & select.POLLERR for _, events in poller.poll(0))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"blocklab: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    _quiet_known_noise()
    yield_while_waiting()  # before any command imports torch; the server's workers inherit it
    try:
        module = importlib.import_module(COMMANDS[name][0])
        return module.main([name, *rest]) or 0
    except BrokenPipeError:
        if not _output_reader_left():  # another pipe (a worker's, say) broke: a bug, with its traceback
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit
        return 1
    except UserError as error:
        message = str(error)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as error:
        # open() and Path.read_text() name the file; ours put it in the message
        message = f"{error.filename}: {error.strerror}" if error.filename else str(error)
    except SystemExit as error:
        if not isinstance(error.code, str):  # argparse's exits, its message already printed
            raise
        # a command's own early exit with a message, e.g. serve/traffic.py's checks of its options
        message = error.code.removeprefix(f"blocklab {name}: ")
    if rest and rest[0] in getattr(sys.modules.get(COMMANDS[name][0]), "SUBCOMMANDS", ()):  # lens report
        name = f"{name} {rest[0]}"
    # one line even when a message quotes a multi-line error from a library
    print(f"blocklab {name}: " + " ".join(message.split()), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
