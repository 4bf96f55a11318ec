"""Command-line flags from a dataclass: each field a flag, its docstring the help, nothing restated.

    config = flags.parse(ServeConfig, argv, prog="blocklab serve", description="Serve a model over HTTP.")

jsonargparse reads the fields' types (``int``, ``float``, ``X | None``, ``Literal[...]``: checked, a
``Literal``'s values listed as the choices) and their docstrings. Flags are spelled the way blocklab's
users type them, with dashes (``--max-new-tokens`` for ``max_new_tokens``; jsonargparse's own
spelling is the field name), and a ``bool`` field is a switch: ``--batch-invariant`` /
``--no-batch-invariant``. ``aliases`` gives some flags other spellings too (``--text`` for
``--prompt``). A bad flag or value ends in the usage and exit status 2, as argparse's do.
"""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from jsonargparse import ArgumentParser, set_parsing_settings

T = TypeVar("T")


class DashedParser(ArgumentParser):
    """jsonargparse's parser; the flags ``add_dataclass`` adds are spelled with dashes."""

    def add_dataclass(self, cls: type, aliases: dict[str, tuple[str, ...]] | None = None) -> None:
        """A flag per field of ``cls``; ``aliases``: other spellings of some fields' flags."""
        self._aliases = aliases or {}
        self._dashing = True
        try:
            self.add_class_arguments(cls, as_group=False)
        finally:
            self._dashing = False

    def add_argument(self, *args, **kwargs):
        """jsonargparse adds a field's flag as ``--field_name``: spell it ``--field-name``."""
        if getattr(self, "_dashing", False) and len(args) == 1 and args[0].startswith("--"):
            name = args[0].removeprefix("--")
            kwargs["dest"] = name
            args = (f"--{name.replace('_', '-')}", *self._aliases.get(name, ()))
            if kwargs.get("type") is bool:
                del kwargs["type"]
                kwargs["action"] = argparse.BooleanOptionalAction
        return super().add_argument(*args, **kwargs)


def parser(
    cls: type, prog: str, description: str, aliases: dict[str, tuple[str, ...]] | None = None
) -> DashedParser:
    """The parser of a command whose options are the fields of dataclass ``cls``."""
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings are the help
    made = DashedParser(prog=prog, description=description)
    made.add_dataclass(cls, aliases)
    return made


def parse(
    cls: type[T],
    argv: list[str],
    prog: str,
    description: str,
    aliases: dict[str, tuple[str, ...]] | None = None,
) -> T:
    """An instance of ``cls`` from the command line ``argv`` (without the program name)."""
    values: dict[str, Any] = parser(cls, prog, description, aliases).parse_args(argv).as_dict()
    return cls(**values)
