"""Command-line flags shared by the examples (not an example itself).

Each ``add_*`` helper adds one kind of flag with its check, its default and a
help string; :func:`parser` shows every default in ``--help``. A bad value is
argparse's error naming the flag and what it must be (exit status 2), before
anything runs.
"""

import argparse
import math
import os

SEED_BOUND = 2**32  # numpy's and JAX's seeds are unsigned 32-bit integers.


def number(kind, low=None, *, open_low=False, high=None, closed_high=False):
  """An argparse ``type``: a finite ``kind`` (int or float) within bounds.

  Args:
    kind: ``int`` or ``float``.
    low: the smallest value allowed, or None.
    open_low: whether ``low`` itself is excluded.
    high: a bound the value must stay below, or None.
    closed_high: whether ``high`` itself is allowed.

  Returns:
    A function that parses the flag's text, or raises
    ``argparse.ArgumentTypeError`` saying what is expected: argparse prints
    ``argument --steps: must be a whole number >= 1; got '0'`` and exits.
  """
  word = "a whole number" if kind is int else "a number"
  bound = "" if low is None else f" {'>' if open_low else '>='} {low}"
  if high is not None:
    bound += f"{' and' if bound else ''} {'<=' if closed_high else '<'} {high}"

  def parse(text):
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not (
      math.isfinite(value)
      and (low is None or value > low or (not open_low and value == low))
      and (high is None or value < high or (closed_high and value == high))
    ):
      raise argparse.ArgumentTypeError(f"must be {word}{bound}; got {text!r}")
    return value

  return parse


def parser(doc):
  """An argument parser described by ``doc``'s first paragraph.

  Args:
    doc: the example's module docstring.

  Returns:
    An ``argparse.ArgumentParser`` whose help shows every flag's default.
  """
  return argparse.ArgumentParser(
    description=doc.split("\n\n", maxsplit=1)[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )


def add_count(parser, flag, default, help_text, low=1):
  """Adds a whole-number flag, at least ``low``."""
  parser.add_argument(
    flag, type=number(int, low), default=default, help=help_text
  )


def add_positive(parser, flag, default, help_text):
  """Adds a number flag that must be > 0."""
  parser.add_argument(
    flag, type=number(float, 0, open_low=True), default=default, help=help_text
  )


def add_seed(parser, help_text="seed of the init and the data"):
  """Adds ``--seed``: a whole number in [0, 2**32), default 0."""
  parser.add_argument(
    "--seed", type=number(int, 0, high=SEED_BOUND), default=0, help=help_text
  )


def add_out(parser, filename, help_text):
  """Adds ``--out``, by default ``filename`` in the examples' ``out/``."""
  here = os.path.dirname(os.path.abspath(__file__))
  parser.add_argument(
    "--out", default=os.path.join(here, "out", filename), help=help_text
  )


def add_variants(parser, variants, help_tail=""):
  """Adds ``--variants``: a comma-separated list of names from ``variants``.

  Args:
    parser: the argument parser.
    variants: the names the example knows (``all`` stands for every one).
    help_tail: text appended to the help string.

  The flag's value is the list of names, in the order given.
  """

  def parse(text):
    if text == "all":
      return list(variants)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in variants]
    if unknown or not names:
      raise argparse.ArgumentTypeError(
        f"unknown {unknown or 'none given'}; choose from " + ", ".join(variants)
      )
    return names

  parser.add_argument(
    "--variants",
    type=parse,
    default="all",
    help="comma-separated, from: " + ", ".join(variants) + help_tail,
  )


def add_dp(parser, noise_multiplier):
  """Adds the DP examples' ``--l2-clip``, ``--noise-multiplier``, ...

  ... ``--target-quantile``: the adaptive per-example clip norm's start, the
  noise in its units, and the quantile it tracks.

  Args:
    parser: the argument parser.
    noise_multiplier: ``--noise-multiplier``'s default.
  """
  add_positive(parser, "--l2-clip", 1.0, "the starting per-example clip norm C")
  parser.add_argument(
    "--noise-multiplier",
    type=number(float, 0),
    default=noise_multiplier,
    help="noise standard deviation in units of C (0: none)",
  )
  parser.add_argument(
    "--target-quantile",
    type=number(float, 0, high=1, closed_high=True),
    default=0.5,
    help="share of examples the adaptive clip norm leaves unclipped",
  )


def check_dp(parser, args):
  """Exits with argparse's error unless ``--batch-size`` exceeds 10 *
  ``--noise-multiplier``, which the noised count of unclipped examples needs
  (Andrew et al. 2021).
  """
  if args.noise_multiplier > 0 and args.batch_size <= 10 * (
    args.noise_multiplier
  ):
    parser.error(
      f"--batch-size must exceed 10 * --noise-multiplier "
      f"({10 * args.noise_multiplier:g}) to noise the unclipped "
      "count (Andrew et al. 2021)"
    )
