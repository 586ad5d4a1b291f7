"""Checks of user input that run before anything heavy (model loading, compilation).

Each raises ValueError/FileNotFoundError with a message naming the bad value and the valid
ones; ``experiments.common.cli`` prints it as one line.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# (spec field, budget field) pairs of the configs: every spec is built at every budget.
SPEC_FIELDS = (("methods", "budgets"), ("interval_methods", "budgets"),
               ("selectors", "budgets"), ("extra", "extra_budgets"), ("method", "budget"),
               ("sweep_selector", "sweep_budget"))


def _known_models() -> tuple:
  """``models.sources.KNOWN_MODELS``, read without running ``models/__init__`` (jax, flax):
  a wrong model name must fail in a blink."""
  init = importlib.util.find_spec("models").origin
  spec = importlib.util.spec_from_file_location(
      "_model_sources", os.path.join(os.path.dirname(init), "sources.py"))
  sources = sys.modules.get(spec.name)
  if sources is None:
    sources = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sources  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(sources)
  return tuple(sources.KNOWN_MODELS)


def check_model(name: str, tiny: bool = True) -> None:
  """A model name that loads: ``tiny-random`` (experiments only: ``tiny``), a registered name,
  a .gguf file or a Hugging Face directory (checked for existence, not loaded)."""
  from experiments.common import modelzoo  # pylint: disable=g-import-not-at-top
  known = ((modelzoo.TINY,) if tiny else ()) + _known_models()
  if name in known or (name.endswith(".gguf") and os.path.isfile(name)) or os.path.isdir(name):
    return
  raise FileNotFoundError(f"model {name!r} is neither a known name ({', '.join(known)}) nor an "
                          "existing .gguf file or Hugging Face directory")


def check_budget(budget, field: str = "budget") -> None:
  if budget is None:
    return
  if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
    raise ValueError(f"{field}={budget!r} is not a budget: give a fraction of the context in "
                     "(0, 1] or a token count > 1")


def check_specs(spec_list, budgets, *, block_size: int = 16) -> None:
  """Every spec builds at every budget (``experiments.tasks.specs``; no model needed)."""
  from experiments.tasks import specs  # pylint: disable=g-import-not-at-top (imports jax)
  specs.expand(list(spec_list), list(budgets), block_size=block_size)


def check_config(config) -> None:
  """The model and every (spec, budget) pair a config names, where its fields say so."""
  for _, budget_field in SPEC_FIELDS:  # cheap checks first
    budgets = config.get(budget_field)
    for b in budgets if isinstance(budgets, (list, tuple)) else [budgets]:
      check_budget(b, f"--config.{budget_field}")
  if isinstance(config.get("model"), str):
    check_model(config.model)
  for spec_field, budget_field in SPEC_FIELDS:
    spec_value = config.get(spec_field)
    if spec_value is None or not (isinstance(spec_value, (list, tuple))
                                  or spec_field in ("method", "sweep_selector")):
      continue
    budgets = config.get(budget_field, ())
    budgets = list(budgets) if isinstance(budgets, (list, tuple)) else [budgets]
    spec_list = [spec_value] if isinstance(spec_value, str) else list(spec_value)
    try:
      check_specs(spec_list, [b for b in budgets if b is not None],
                  block_size=config.get("block_size", 16))
    except (ValueError, TypeError) as e:
      raise ValueError(f"--config.{spec_field}: {e}") from e
