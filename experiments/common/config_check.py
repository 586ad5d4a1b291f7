"""Config values checked against the config file's own defaults, before anything heavy loads.

``check(config, get_config)`` runs on every experiment's parsed config (``cli.parsed``), before
JAX, a model or data is imported, and raises a ValueError that names the field, the value and
what the field accepts:

* a field keeps the type of its defaults (``get_config(False)`` and ``get_config(True)``): a
  tuple of ints stays a tuple of ints (``--config.lengths=(abc,)`` is refused); an int is
  accepted where a float is;
* numbers keep the sign of their defaults: positive where every default is (lengths, sample
  counts, batch sizes), non-negative where every default is (seeds, ``max_new_tokens=0``);
* a string of comma-separated integers (``contexts="8192,32768"``) stays one;
* ``tasks``, ``protocol`` and the text fields (``haystack``, ``text``, ...) take names from a
  fixed list, where the config's defaults are among them.

Budget fields are left to ``checks.check_budget`` (its message names the budget rule); method
specs and models to ``checks.check_config``. ``unknown_field`` turns ml_collections' traceback
for ``--config.nosuchkey=3`` into one line with the fields there are.
"""

from __future__ import annotations

import difflib
import re

from experiments.common import checks

PROTOCOLS = ("query_aware", "query_agnostic")  # experiments.tasks.accuracy's protocols
_TEXT_FIELDS = ("haystack", "text", "calib_text", "heldout_text")
_INT_LIST = re.compile(r"\d+(,\d+)*")
_BUDGET_FIELDS = {b for _, b in checks.SPEC_FIELDS}  # checks.check_budget names the rule
# Items of tuples whose defaults are empty: what they would hold (needle depths, layer indices).
_ITEMS = {"depths": (0.0, 1.0), "layers": (0,)}


def _choices(field: str):
  """The names ``field`` accepts, or None (imported lazily: each is light, none loads JAX)."""
  if field == "tasks":
    from experiments.common import task_names  # pylint: disable=g-import-not-at-top
    return task_names.TASKS
  if field == "protocol":
    return PROTOCOLS
  if field in _TEXT_FIELDS:
    from experiments.common import data  # pylint: disable=g-import-not-at-top
    return data.TEXT_SOURCES
  return None


def show(value) -> str:
  """A config value as it is written on the command line (``4096,8192``; ``()`` when empty)."""
  if isinstance(value, (list, tuple)):
    return ",".join(show(v) for v in value) if value else "()"
  return str(value)


def _is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Kind:
  """What a field accepts, inferred from its default values (``examples``)."""

  def __init__(self, field: str, examples: list):
    self.sequence = bool(examples) and all(isinstance(e, (list, tuple)) for e in examples)
    items = [x for e in examples for x in e] if self.sequence else examples
    if self.sequence and not items:
      items = list(_ITEMS.get(field, ()))
    self.item = None if self.sequence and not items else _Item(field, items)

  def error(self, value) -> str | None:
    """None if ``value`` fits, else what the field accepts."""
    if not self.sequence:
      return None if self.item.fits(value) else self.item.describe()
    what = f"a tuple of {self.item.plural()}" if self.item else "a tuple"
    if not isinstance(value, (list, tuple)):
      return what
    if self.item and not all(self.item.fits(v) for v in value):
      return what
    return None


class _Item:
  """One scalar: a bool, a number with a sign, a string (of ints, or of fixed names), a tuple."""

  def __init__(self, field: str, examples: list):
    self.kind = self._kind(examples)
    self.sign = None
    self.choices = None
    self.inner = None
    if self.kind in ("int", "number") and field not in _BUDGET_FIELDS:
      self.sign = ("positive" if all(e > 0 for e in examples)
                   else "non-negative" if all(e >= 0 for e in examples) else None)
    if self.kind == "str":
      if all(_INT_LIST.fullmatch(e) for e in examples):
        self.kind = "int_list"
      else:
        choices = _choices(field)
        if choices and all(e in choices for e in examples):
          self.choices = tuple(choices)
    if self.kind == "tuple":
      self.inner = _Kind(field, examples)

  @staticmethod
  def _kind(examples) -> str | None:
    if examples and all(isinstance(e, bool) for e in examples):
      return "bool"
    if examples and all(isinstance(e, int) and not isinstance(e, bool) for e in examples):
      return "int"
    if examples and all(_is_number(e) for e in examples):
      return "number"
    if examples and all(isinstance(e, str) for e in examples):
      return "str"
    if examples and all(isinstance(e, (list, tuple)) for e in examples):
      return "tuple"
    return None  # no default to infer from (None, mixed): anything goes

  def fits(self, v) -> bool:
    if self.kind is None:
      return True
    if self.kind == "bool":
      return isinstance(v, bool)
    if self.kind in ("int", "number"):
      ok = isinstance(v, int) if self.kind == "int" else True
      if not (_is_number(v) and ok):
        return False
      return {"positive": v > 0, "non-negative": v >= 0}.get(self.sign, True)
    if self.kind == "int_list":
      return isinstance(v, str) and bool(_INT_LIST.fullmatch(v.replace(" ", "")))
    if self.kind == "str":
      return isinstance(v, str) and (self.choices is None or v in self.choices)
    return self.inner.error(v) is None  # a tuple

  def describe(self) -> str:
    return self._words()[0]

  def plural(self) -> str:
    return self._words()[1]

  def _words(self) -> tuple[str, str]:
    sign = f"{self.sign} " if self.sign else ""
    if self.kind == "int":
      return (f"a {sign}integer" if sign else "an integer"), f"{sign}integers"
    if self.kind == "number":
      return f"a {sign}number", f"{sign}numbers"
    if self.kind == "bool":
      return "True or False", "booleans (True or False)"
    if self.kind == "int_list":
      return ("comma-separated non-negative integers",
              "strings of comma-separated integers")
    if self.choices:
      names = ", ".join(self.choices)
      return f"one of {names}", f"names among {names}"
    if self.kind == "str":
      return "a string", "strings"
    inner = self.inner.item.plural() if self.inner.item else "values"
    return f"a tuple of {inner}", f"tuples of {inner}"


def check(config, get_config) -> None:
  """Raises ValueError at the first field of ``config`` whose value its defaults rule out.

  Args:
    config: the parsed (quick-resolved) ConfigDict.
    get_config: its config module's ``get_config(quick: bool)``.
  """
  defaults = [get_config(False), get_config(True)]
  for field in config.keys():
    examples = [d[field] for d in defaults if field in d]
    if not examples:
      continue
    wrong = _Kind(field, examples).error(config[field])
    if wrong:
      raise ValueError(f"--config.{field}={show(config[field])}: expects {wrong} (default: "
                       f"{show(examples[0])})")


def unknown_field(argv, get_config, path: str) -> str | None:
  """The one-line error for the first ``--config.FIELD=...`` of ``argv`` that ``path``'s config
  has no field for (None when every override names a field)."""
  fields = list(get_config(False).keys())
  for arg in argv:
    m = re.match(r"-{1,2}config\.([^=.]+)", arg)
    if m and m.group(1) not in fields:
      name = m.group(1)
      near = difflib.get_close_matches(name, fields, n=1)
      hint = f" (did you mean {near[0]}?)" if near else ""
      return (f"--config.{name}: {path} has no field {name!r}{hint}; its fields: "
              f"{', '.join(fields)}")
  return None
