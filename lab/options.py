"""Command-line options generated from a typed dataclass (jsonargparse), spelled as shell users type them.

    @dataclass
    class Options:
        steps: int = 100
        \"\"\"Optimiser steps.\"\"\"          # the field's docstring is its --help text
        block_sets: list[str] = field(default_factory=list)
        force: bool = False

    options = parse(Options, argv[1:], prog="blocklab thing", description="What it does.")
    # blocklab thing --steps 5 --block-sets all skip=5 --force

jsonargparse (as litgpt and LightningCLI use it) derives the flags, their types, defaults and help from the
dataclass, validates the values and reads ``--config FILE.yaml``. What this adds is the spelling of a Unix
command line, which jsonargparse leaves out: dashed names (``--max-new-tokens``, with ``--max_new_tokens``
accepted too), boolean flags that stand alone (``--force``; ``--force false`` still works), and lists as
separate words (``--block-sets all skip=5``; a JSON list works too).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import TypeVar

import jsonargparse

T = TypeVar("T")

jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)


def _list_items(hint) -> tuple | None:
    """The item types of a list hint (``list[X]`` or ``list[X] | None``); None for other hints."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for option in typing.get_args(hint) if union else (hint,):
        if typing.get_origin(option) is list:
            return typing.get_args(option)
    return None


def parser(cls: type, prog: str, description: str) -> jsonargparse.ArgumentParser:
    """The jsonargparse parser of ``cls``'s fields, with dashed aliases of every multi-word flag."""
    result = jsonargparse.ArgumentParser(prog=prog, description=description)
    result.add_class_arguments(cls, as_positional=False)
    for action in result._actions:  # argparse's table of flags: the one place aliases can be added
        for flag in list(action.option_strings):
            if flag.startswith("--") and "_" in flag and not flag.endswith("+"):
                dashed = flag.replace("_", "-")
                action.option_strings.insert(0, dashed)
                result._option_string_actions[dashed] = action
    return result


def shell_words(cls: type, argv: list[str]) -> list[str]:
    """``argv`` with bare boolean flags given ``true`` and lists of words joined as one JSON list."""
    hints = typing.get_type_hints(cls)
    field_of = {}
    for field in dataclasses.fields(cls):
        field_of[f"--{field.name}"] = field_of[f"--{field.name.replace('_', '-')}"] = field.name
    words, i = [], 0
    while i < len(argv):
        flag, inline = argv[i], "=" in argv[i]
        hint = hints.get(field_of.get(flag, ""))
        following = []  # the words after the flag, up to the next flag
        for word in argv[i + 1 :]:
            if word.startswith("--"):
                break
            following.append(word)
        items = _list_items(hint)
        if inline or hint is None:
            words.append(flag)
        elif hint is bool and not (following and following[0].lower() in ("true", "false")):
            words += [flag, "true"]
        elif items is not None and following and not following[0].startswith("["):
            values = following if items == (str,) else [_json_or_word(value) for value in following]
            words += [flag, json.dumps(values)]
            i += len(following)
        else:
            words.append(flag)
        i += 1
    return words


def _json_or_word(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse(cls: type[T], argv: list[str], prog: str, description: str) -> T:
    """An instance of ``cls`` from the command line ``argv`` (without the program name)."""
    options = parser(cls, prog, description)
    namespace = options.parse_args(shell_words(cls, argv))
    namespace.pop("config", None)
    return cls(**namespace.as_dict())
