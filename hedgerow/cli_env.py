"""Every option of the ``hedgerow`` command, settable from the environment.

One scheme: ``HEDGEROW_<COMMAND>_<OPTION>``, the subcommand path and the long
option upper-cased with dashes as underscores. ``hedgerow gateway --port`` is
``HEDGEROW_GATEWAY_PORT``, ``hedgerow cache purge --tenant`` is
``HEDGEROW_CACHE_PURGE_TENANT``, the top-level ``--log-level`` is
``HEDGEROW_LOG_LEVEL``. Scoped by subcommand because the same option means
different things to different process kinds (``--port`` is 8443 for a
gateway, 8500 for a control plane, 0 for a worker) and a shell or a unit file
often starts more than one.

Precedence: the command line, then ``HEDGEROW_<COMMAND>_<OPTION>``, then the
shared names that predate the scheme (``HEDGEROW_REDIS_URL``, ``HEDGEROW_POP``,
``HEDGEROW_CONTROL_PLANE``, ``HEDGEROW_ADMIN_URL``, ``HEDGEROW_ADMIN_IDENTITY``,
``HEDGEROW_REDIS_*_FILE``: read by the options' own defaults), then the
built-in default. Switches take 1/true/yes/on or 0/false/no/off; repeatable
options take a comma-separated list.

``--join-token`` is the exception: its variable is ``HEDGEROW_JOIN_TOKEN``,
read after ``--join-token`` and ``--join-token-file``, so a token file given
on the command line still wins over a token in the environment.

Values from the environment become the options' defaults; no help text shows
a default it did not write itself, so a secret (a Redis URL with a password,
a token) never reaches ``--help``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from typing import Any

PREFIX = "HEDGEROW"
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off", ""})
# Options whose environment form is read by their own code, not by this walker.
OWN_VARIABLE = {"--join-token": "HEDGEROW_JOIN_TOKEN"}


class EnvironmentValueError(ValueError):
    """A HEDGEROW_* variable holds a value its option refuses."""


def env_name(command: tuple[str, ...], option: str) -> str:
    """``("cache", "purge"), "--admin-url"`` → ``HEDGEROW_CACHE_PURGE_ADMIN_URL``."""
    if option in OWN_VARIABLE:
        return OWN_VARIABLE[option]
    words = [*command, option.lstrip("-")]
    return "_".join([PREFIX, *(w.replace("-", "_").upper() for w in words)])


def walk(parser: argparse.ArgumentParser, command: tuple[str, ...] = ()
         ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser under ``parser`` (itself first) with its subcommand path."""
    yield command, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, (*command, name))


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The parser's own options (not help, version or subcommands)."""
    for action in parser._actions:
        if (action.option_strings and action.dest != argparse.SUPPRESS
                and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            yield action


def long_option(action: argparse.Action) -> str:
    return next((o for o in action.option_strings if o.startswith("--")),
                action.option_strings[0])


def apply_environment(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Name each option's variable in its help, and let a set one be its default."""
    for command, sub in walk(parser):
        for action in options(sub):
            name = env_name(command, long_option(action))
            if action.help not in (None, argparse.SUPPRESS):
                action.help = f"{action.help} [env {name}]"
            if name in environ and name not in OWN_VARIABLE.values():
                _use(sub, action, name, environ[name])


def _use(parser: argparse.ArgumentParser, action: argparse.Action, name: str,
         raw: str) -> None:
    try:
        action.default = _value(action, raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as error:
        raise EnvironmentValueError(f"${name}={raw!r}: {error}") from error
    if isinstance(action, argparse._AppendAction):
        action.__class__ = _AppendReplacingDefault
    # A value from the environment satisfies a required option (or group).
    action.required = False
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            group.required = False


class _AppendReplacingDefault(argparse._AppendAction):
    """A repeatable option whose default came from the environment: values on the
    command line replace that list rather than extend it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


def _value(action: argparse.Action, raw: str) -> Any:
    if action.nargs == 0:  # a switch: store_true, store_false, store_const
        word = raw.strip().lower()
        if word in TRUE:
            return action.const
        if word in FALSE:
            return action.default
        raise ValueError("want 1/true/yes/on or 0/false/no/off")
    if isinstance(action, argparse._AppendAction):
        return [_one(action, part.strip()) for part in raw.split(",") if part.strip()]
    return _one(action, raw)


def _one(action: argparse.Action, raw: str) -> Any:
    value = action.type(raw) if callable(action.type) else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"not one of {', '.join(map(str, action.choices))}")
    return value
