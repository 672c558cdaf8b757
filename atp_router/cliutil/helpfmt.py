"""The help formatter of the ``atp-router`` commands (the router's own and the
subcommands other packages implement): every option's default in its ``--help``
line."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's :class:`~argparse.ArgumentDefaultsHelpFormatter` ("… (default: 64)"),
    except where the default says nothing or is said already: flags (options that
    take no value), options whose default is ``None`` or empty, and help text that
    already names its default (so a default read from the environment, e.g. a
    token, is never printed). An option needs a help text for its default to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        flag = action.nargs == 0  # store_true / store_false / store_const: no value to default
        if flag or default is None or default == [] or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
