"""Command-line checks shared by the examples (not an example itself)."""

import argparse
import math


def number(kind, low=None, *, open_low=False, high=None):
  """An argparse ``type``: a finite ``kind`` (int or float) within bounds.

  Args:
    kind: ``int`` or ``float``.
    low: the smallest value allowed, or None.
    open_low: whether ``low`` itself is excluded.
    high: a bound the value must stay below, or None.

  Returns:
    A function that parses the flag's text, or raises
    ``argparse.ArgumentTypeError`` saying what is expected: argparse prints
    ``argument --steps: must be a whole number >= 1; got '0'`` and exits.
  """
  word = "a whole number" if kind is int else "a number"
  bound = "" if low is None else f" {'>' if open_low else '>='} {low}"
  if high is not None:
    bound += f"{' and' if bound else ''} < {high}"

  def parse(text):
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not (
      math.isfinite(value)
      and (low is None or value > low or (not open_low and value == low))
      and (high is None or value < high)
    ):
      raise argparse.ArgumentTypeError(f"must be {word}{bound}; got {text!r}")
    return value

  return parse
