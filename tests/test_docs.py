"""Every public function documents itself with a runnable example.

The examples themselves run as doctests (``--doctest-modules``); this checks
that none is missing and that the namespace lists what it exports.
"""

import inspect

from absl.testing import absltest

import optaxclip


class DocsTest(absltest.TestCase):
  def test_every_public_function_has_a_doctest(self):
    functions = [
      name
      for name in optaxclip.__all__
      if inspect.isfunction(getattr(optaxclip, name))
    ]
    self.assertNotEmpty(functions)
    for name in functions:
      doc = inspect.getdoc(getattr(optaxclip, name)) or ""
      self.assertIn(">>> ", doc, f"{name} has no doctest example")

  def test_all_is_sorted_and_complete(self):
    self.assertEqual(list(optaxclip.__all__), sorted(optaxclip.__all__))
    for name in optaxclip.__all__:
      self.assertTrue(hasattr(optaxclip, name), name)


if __name__ == "__main__":
  absltest.main()
