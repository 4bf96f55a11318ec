"""Command-line parsers from dataclasses and typed functions (jsonargparse, as litgpt's commands are built).

    @dataclass
    class Options:
        steps: int = 300
        '''Training steps per run.'''

    parser = flags.Parser("blocklab stall", "The post-LN stall.")
    parser.add_options(Options)            # --steps, its type checked, its docstring as --help
    args = parser.parse(argv)              # args.steps

    flags.call(main)                       # a script: main's typed parameters are its flags

Each field (or parameter) is one flag named after it; its type checks the value and its docstring (a
field's docstring, or a function's ``Args:``) is the ``--help`` text. jsonargparse reads ``--n_embd 384``,
``--json true`` and lists as ``--seeds [1, 7]``; blocklab's commands have always taken argparse's
spellings, which ``Parser.parse`` translates first (the table in ``SPELLINGS``). A wrong value or an
unknown flag raises ``lab.errors.UserError``: ``blocklab`` prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from jsonargparse import ArgumentError, ArgumentParser, DefaultHelpFormatter, Namespace, set_parsing_settings

from lab.errors import UserError

# A dataclass field's docstring is its --help text (jsonargparse reads them only when asked).
set_parsing_settings(docstring_parse_attribute_docstrings=True)

SPELLINGS = """\
Flags are also read as argparse writes them: --n-embd 384 for --n_embd 384, --json alone for
--json true (--no-X for --X false), and a list as separate words, --seeds 1 7, for --seeds [1, 7]."""

T = TypeVar("T")
_LIST_ORIGINS = (list, tuple, collections.abc.Sequence)


def _kind(hint: Any) -> str | None:
    """``"bool"`` or ``"list"`` for the types whose flags argparse spells differently, else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # Optional[X] reads as X
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _kind(args[0]) if len(args) == 1 else None
    if hint is bool:
        return "bool"
    return "list" if typing.get_origin(hint) in _LIST_ORIGINS else None


def _names_and_hints(options: type | Callable) -> dict[str, Any]:
    hints = typing.get_type_hints(options)
    if dataclasses.is_dataclass(options):
        return {field.name: hints[field.name] for field in dataclasses.fields(options) if field.init}
    return {name: hints[name] for name in inspect.signature(options).parameters if name in hints}


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help (types and defaults), the description and epilog as written (examples kept)."""


class Parser(ArgumentParser):
    """A jsonargparse parser whose flags come from dataclasses and typed functions (``add_options``)."""

    def __init__(self, prog: str, description: str | None = None, **kwargs):
        kwargs = {"epilog": SPELLINGS, "formatter_class": _HelpFormatter, "exit_on_error": False, **kwargs}
        super().__init__(prog=prog, description=description, **kwargs)
        self.kinds: dict[str, str | None] = {}  # every flag of add_options -> _kind of its type

    def add_options(self, options: type | Callable, *, skip: Sequence[str] = (), **defaults: Any) -> None:
        """A flag per field of the dataclass ``options`` (or parameter of the function), except ``skip``;
        ``defaults`` replace the declared defaults of some of them."""
        if dataclasses.is_dataclass(options):
            self.add_class_arguments(options, as_group=True, skip=set(skip))
        else:
            self.add_function_arguments(options, as_group=True, skip=set(skip))
        for name, hint in _names_and_hints(options).items():
            if name not in skip:
                self.kinds[name] = _kind(hint)
                self._show_dashed(name)
        if defaults:
            self.set_defaults(defaults)

    def _show_dashed(self, name: str) -> None:
        """``--help`` shows the flag ``--field_name`` as the shell spelling ``--field-name`` (``parse``
        translates that spelling back; argparse's table of flags keeps both)."""
        flag = f"--{name}"
        action = self._option_string_actions.get(flag)
        if action is not None and "_" in name:
            dashed = flag.replace("_", "-")
            action.option_strings[action.option_strings.index(flag)] = dashed
            self._option_string_actions[dashed] = action

    def parse(self, argv: Sequence[str]) -> Namespace:
        """``argv`` parsed (argparse's spellings first translated); a bad flag or value is a UserError."""
        try:
            args = self.parse_args(self.jsonargparse_argv(argv))
        except ArgumentError as error:
            raise UserError(_in_plain_words(str(error))) from None
        for key, value in args.items():
            args[key] = _plain(value)
        return args

    def jsonargparse_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` with argparse's spellings (``SPELLINGS``) written as jsonargparse reads them."""
        out: list[str] = []
        rest = list(argv)
        while rest:
            token = rest.pop(0)
            if not token.startswith("--") or token == "--":
                out.append(token)
                continue
            name, has_value, value = token[2:].partition("=")
            name = self._full_name(name.replace("-", "_"))
            if name.startswith("no_") and name not in self.kinds and self.kinds.get(name[3:]) == "bool":
                out += [f"--{name[3:]}", "false"]
                continue
            kind = self.kinds.get(name)
            if has_value:
                out.append(f"--{name}={_one_list(value) if kind == 'list' else value}")
            elif kind is None:
                out.append(f"--{name}")
            elif kind == "bool":
                given = bool(rest) and rest[0].lower() in ("true", "false")
                if rest and not given and not rest[0].startswith("-"):  # no command takes positionals
                    flag = f"--{name.replace('_', '-')}"
                    raise UserError(f"{flag}: true or false (or the flag alone), got {rest[0]!r}")
                out += [f"--{name}", rest.pop(0) if given else "true"]
            else:
                words = []
                while rest and not rest[0].startswith("--"):
                    words.append(rest.pop(0))
                out += [f"--{name}", *_list(words)]
        return out

    def _full_name(self, name: str) -> str:
        """``name``, or the one flag of ``add_options`` it abbreviates (argparse's ``--exit`` for
        ``--exits``); what is neither stays as given, for argparse to refuse."""
        if f"--{name}" in self._option_string_actions:
            return name
        longer = [flag for flag in self.kinds if flag.startswith(name)]
        return longer[0] if len(longer) == 1 else name


def _list(words: list[str]) -> list[str]:
    """The words of a list flag as one jsonargparse value: ``1 7`` -> ``["1", "7"]`` (jsonargparse reads
    each item as the list's item type); a value already written as a list is kept."""
    if len(words) == 1 and words[0].startswith("["):
        return words
    return [json.dumps(words)] if words else []


def _one_list(value: str) -> str:
    return value if value.startswith("[") else json.dumps([value])


def options(cls: type[T], args: Namespace) -> T:
    """The dataclass ``cls`` made from its fields' values in ``args`` (parsed with ``add_options(cls)``)."""
    return cls(**{field.name: args[field.name] for field in dataclasses.fields(cls) if field.init})


def _plain(value: Any) -> Any:
    """``value`` with jsonargparse's checked numbers (``PositiveInt``, a subclass of int) as plain ints
    and floats: they travel into checkpoints that ``torch.load(weights_only=True)`` reads back, and
    it unpickles no class of jsonargparse's."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int) and type(value) is not int:
        return int(value)
    if isinstance(value, float) and type(value) is not float:
        return float(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


_POSITIVE_INT = re.compile(r'Parser key "(\w+)":.*PositiveInt', re.DOTALL)
_GIVEN = re.compile(r"Given value: (\S+)|(-?\w+) does not conform|with base 10: '([^']*)'")


def _in_plain_words(message: str) -> str:
    """jsonargparse's refusal of a value for a ``PositiveInt`` flag (a union's, at length) as one plain
    sentence; any other message as it is."""
    flag, given = _POSITIVE_INT.search(message), _GIVEN.search(message)
    if flag is None or given is None:
        return message
    value = next(group for group in given.groups() if group is not None)
    return f"--{flag[1].replace('_', '-')} must be a whole number of at least 1, got {value}"


def parse(cls: type[T], argv: Sequence[str], prog: str, description: str | None = None) -> T:
    """The dataclass ``cls`` from the flags in ``argv`` (one flag per field, see ``Parser``)."""
    parser = Parser(prog, description)
    parser.add_options(cls)
    return options(cls, parser.parse(argv))


def command_parser(command: Callable, prog: str, description: str | None = None) -> Parser:
    """The flags of ``command``'s typed parameters (its docstring's ``Args:`` as their help);
    ``description`` defaults to the docstring's first paragraph."""
    parser = Parser(prog, description or inspect.getdoc(command).split("\n\n")[0])
    parser.add_options(command)
    return parser


def run(command: Callable, argv: Sequence[str], prog: str, description: str | None = None) -> Any:
    """Parse ``argv`` into ``command``'s typed parameters (``command_parser``) and call it."""
    return command(**command_parser(command, prog, description).parse(argv).as_dict())


def script_parser(main: Callable) -> Parser:
    """A script's parser: ``main``'s parameters, described by its module docstring's first paragraph."""
    script = main.__globals__  # the module's own namespace, however it was loaded
    description = inspect.cleandoc(script["__doc__"]).split("\n\n")[0]
    return command_parser(main, Path(script["__file__"]).name, description)


def call(main: Callable, argv: Sequence[str] | None = None) -> Any:
    """A script's entry point: ``argv`` (default: the command line) parsed by ``script_parser(main)``
    into ``main``'s parameters, and ``main`` called. A bad flag, or a UserError from ``main``, prints
    one line and exits with status 2, as argparse does."""
    parser = script_parser(main)
    try:
        args = parser.parse(sys.argv[1:] if argv is None else argv)
        return main(**args.as_dict())
    except UserError as error:
        print(f"{parser.prog}: " + " ".join(str(error).split()), file=sys.stderr)
        raise SystemExit(2) from None
