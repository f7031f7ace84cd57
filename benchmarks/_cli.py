"""The command line of the benchmark scripts: a one-line description and every option's default
in --help.

    from _cli import make_parser
    parser = make_parser("Optimizer-step benchmark: titanmac_c against torch.")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per variant")

--help appends "(default: X)" to each option's help, except where the help already says what the
default is (an option whose default is computed at run time, e.g. "default: by device").
"""

import argparse


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """ArgumentDefaultsHelpFormatter that leaves a help text naming its own default alone and
    shows a store_true flag's default as off."""

    def _get_help_string(self, action):
        help = action.help or ""
        if "default" in help:
            return help
        if isinstance(action, argparse._StoreTrueAction):
            return f"{help} (default: off)" if help else "(default: off)"
        return super()._get_help_string(action)


def make_parser(description):
    """An ArgumentParser whose --help shows `description` and each option's default."""
    return argparse.ArgumentParser(description=description, formatter_class=DefaultsFormatter)
