"""The ``blocklab`` command: one entry point, a subcommand per job.

Each subcommand lives in its own module with a ``main(argv)``; modules are imported only when their
command runs, so ``blocklab --help`` is instant and the library does not load the server's stack.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("lab.train", "train one model from a LightningCLI YAML config (also: validate)"),
    "validate": ("lab.train", "evaluate a checkpoint on the validation split"),
    "stall": ("lab.stall", "reproduce the post-LN warmup stall: pre-LN vs post-LN, with/without warmup"),
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
