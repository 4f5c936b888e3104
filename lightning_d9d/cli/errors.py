"""One readable line for a misconfigured ``lightning-d9d`` run, instead of a usage screen or a traceback.

Parse errors are condensed from jsonargparse's tree of Union branches to ``key: what is wrong (what is valid)``;
configuration errors raised while building or running print their message without a traceback. Any other
exception is a bug and keeps its traceback; ``LIGHTNING_D9D_TRACEBACK=1`` restores the full output.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from typing import Any, NoReturn

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser

TRACEBACK_ENV = "LIGHTNING_D9D_TRACEBACK"
"""Set to 1 for jsonargparse's full messages and Python's tracebacks instead of the one-line errors."""
CONFIGURATION_ERRORS = (ValueError, OSError, MisconfigurationException)
"""What a configuration can cause: reported in one line."""

# Lines of jsonargparse's Union report that describe the search, not the problem.
_SEARCH_LINES = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value type:",
    "Expected a <class 'NoneType'>",
)
_RESTRICTED_TYPES = {
    "PositiveInt": "an integer > 0",
    "NonNegativeInt": "an integer >= 0",
    "PositiveFloat": "a number > 0",
    "NonNegativeFloat": "a number >= 0",
    "OpenUnitInterval": "a number in (0, 1)",
    "ClosedUnitInterval": "a number in [0, 1]",
}


class ConfigurationError(ValueError):
    """A class of the config could not be built from its arguments (a ``TypeError`` or ``ImportError`` there)."""


def full_tracebacks() -> bool:
    """Whether ``LIGHTNING_D9D_TRACEBACK`` asks for the full messages (any value but empty, 0, false, no)."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no")


class ReadableErrorParser(LightningArgumentParser):
    """LightningArgumentParser whose parse errors are one condensed line and a hint, exit code 2."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if full_tracebacks() or not self.exit_on_error:
            super().error(message, ex)  # raises (inside jsonargparse's own trials) or prints everything
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        unrecognized = re.match(r"(?i)unrecognized arguments: (.+)$", message.strip())
        text = _unrecognized(unrecognized[1], parser) if unrecognized else condense_parse_error(message)
        sys.stderr.write(f"{prog}: error: {text}\n")
        sys.stderr.write(f"  (every option: {prog} --help; jsonargparse's full message: {TRACEBACK_ENV}=1)\n")
        self.exit(2)


def report_configuration_error(error: BaseException, command: str = "lightning-d9d") -> NoReturn:
    """Print ``error``'s message without its traceback (a re-raised worker traceback cut to its last line), exit 1."""
    message = str(error).strip() or type(error).__name__
    if "Traceback (most recent call last)" in message:
        message = message.splitlines()[-1].strip()
    elif "Does not validate against any of the Union subtypes" in message:
        message = condense_parse_error(message)  # jsonargparse wraps what a class's __init__ raised
    if isinstance(error, OSError) and not isinstance(error, MisconfigurationException):
        message = f"{type(error).__name__}: {message}"
    sys.stderr.write(f"{command}: error: {message}\n")
    sys.stderr.write(f"  (the traceback: run again with {TRACEBACK_ENV}=1)\n")
    raise SystemExit(1)


def condense_parse_error(message: str) -> str:
    """``key: problem`` from jsonargparse's nested error report."""
    keys: list[str] = []
    reasons: list[str] = []
    given: str | None = None
    class_path: str | None = None
    for raw in message.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if not line or line.startswith(_SEARCH_LINES):
            continue
        if line.startswith("Given value:"):
            value = line.partition(":")[2].strip()
            if given is None and not value.startswith(("NestedArg(", "{", "[")) and len(value) <= 80:
                given = value
            continue
        match = re.match(r'Parser key "([^"]+)":\s*(.*)$', line)
        if match:
            keys.append(match[1])
            line = match[2]
            if not line:
                continue
        match = re.match(r"Problem with given class_path '([^']+)':\s*(.*)$", line)
        if match:
            class_path = match[1]
            keys.append("init_args")
            line = match[2]
            if not line:
                continue
        option = re.match(r"Option '([^']+)' is not accepted", line)
        if option:
            keys.append(option[1])
            reasons.append(_unknown_option(option[1], class_path))
            continue
        if class_path is not None and keys and keys[-1] == "init_args" and _is_import_failure(line):
            keys[-1] = "class_path"
            reasons.append(_unimportable_class(class_path, line))
            continue
        reasons.append(_plain_reason(line))
    if not reasons:
        return message.strip().splitlines()[0] if message.strip() else "invalid arguments"
    unique = list(dict.fromkeys(reasons))
    text = "; ".join(unique)
    if given is not None and f"got {given!r}" not in text and f"got {given}" not in text:
        text += f" (got {given})"
    return f"{'.'.join(keys)}: {text}" if keys else text


def _plain_reason(line: str) -> str:
    match = re.match(r"Not of type (\w+): (.*)$", line)
    if match:
        valid = f"must be {_RESTRICTED_TYPES.get(match[1], f'a {match[1]}')}"
        restriction = re.match(r"(.*?)\s*does not conform to restriction (.+)$", match[2])
        if restriction:
            return f"{valid}, got {restriction[1]}" if restriction[1] else valid
        literal = re.search(r"invalid literal for \w+\(\) with base \d+: (.+)$", match[2])
        return f"{valid}, got {literal[1]}" if literal else f"{valid} ({match[2]})"
    match = re.match(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$", line)
    if match:
        return f"must be one of {match[1]}, got {match[2]!r}"
    match = re.match(r"Expected a <class '([\w.]+)'>\. Got value: (.*)$", line)
    if match:
        return f"must be of type {match[1]}, got {match[2]!r}"
    return line


def _unrecognized(arguments: str, parser: LightningArgumentParser) -> str:
    """Name the unknown flags and the closest flags the parser knows."""
    known = [option for option in parser._option_string_actions if option.startswith("--")]
    flags = [argument.split("=")[0] for argument in arguments.split() if argument.startswith("-")]
    close = [match for flag in flags for match in difflib.get_close_matches(flag, known, n=2)]
    hint = f"; did you mean {' or '.join(dict.fromkeys(close))}?" if close else ""
    return f"unrecognized arguments: {arguments}{hint}"


def _is_import_failure(line: str) -> bool:
    return bool(re.search(r"has no attribute|No module named|Import path|not a subclass|could not be resolved", line))


def _unknown_option(option: str, class_path: str | None) -> str:
    accepted = _init_parameters(class_path)
    if not accepted:
        return f"unknown option {option!r}"
    close = difflib.get_close_matches(option, accepted, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown option {option!r} of {class_path}; {hint}accepted: {', '.join(accepted)}"


def _init_parameters(class_path: str | None) -> list[str]:
    cls = _import(class_path) if class_path else None
    if cls is None:
        return []
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _unimportable_class(class_path: str, line: str) -> str:
    module_name, _, name = class_path.rpartition(".")
    module = _import_module(module_name) if module_name else None
    if module is None:
        return f"cannot import {class_path!r} ({line})"
    close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")], n=3)
    if not close:
        return f"{module_name} has no {name!r} ({line})"
    return f"{module_name} has no {name!r}; did you mean {' or '.join(f'{module_name}.{c}' for c in close)}?"


def _import(class_path: str) -> Any:
    module_name, _, name = class_path.rpartition(".")
    module = _import_module(module_name) if module_name else None
    return getattr(module, name, None) if module is not None else None


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
