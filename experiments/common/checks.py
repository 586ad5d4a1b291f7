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
  sources = sys.modules.get("models.sources") or sys.modules.get("_model_sources")
  if sources is None:
    init = importlib.util.find_spec("models").origin
    spec = importlib.util.spec_from_file_location(
        "_model_sources", os.path.join(os.path.dirname(init), "sources.py"))
    sources = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sources  # dataclasses look their module up while it executes
    try:
      spec.loader.exec_module(sources)
    except Exception:  # pylint: disable=broad-except (fall back to the full package import)
      del sys.modules[spec.name]
      from models import sources  # pylint: disable=g-import-not-at-top,redefined-outer-name
  return tuple(sources.KNOWN_MODELS)


def check_model(name: str, tiny: bool = True) -> None:
  """A model name that loads: ``tiny-random`` or ``random:SHAPE[:DIR]`` (experiments only:
  ``tiny``), a registered name, a .gguf file or a Hugging Face directory (checked for existence,
  not loaded)."""
  from experiments.common import modelzoo  # pylint: disable=g-import-not-at-top
  known = ((modelzoo.TINY,) if tiny else ()) + _known_models()
  if name in known or (name.endswith(".gguf") and os.path.isfile(name)) or os.path.isdir(name):
    return
  random = modelzoo.parse_random(name) if tiny else None  # random:SHAPE[:DIR] (experiments)
  if random:
    if random[1] and not os.path.isfile(os.path.join(random[1], "tokenizer.json")):
      raise FileNotFoundError(f"model {name!r}: {random[1]} holds no tokenizer.json")
    return
  raise FileNotFoundError(f"model {name!r} is neither a known name ({', '.join(known)}) nor an "
                          "existing .gguf file or Hugging Face directory")


def check_budget(budget, field: str = "budget") -> None:
  """``budget`` passes ``sparse_attn.budget.parse_budget`` (the one validation ``methods.make``
  and ``specs.build`` use); its error is prefixed with ``field=value``."""
  if budget is None:
    return
  from sparse_attn import budget as budget_lib  # pylint: disable=g-import-not-at-top
  try:
    budget_lib.parse_budget(budget)
  except ValueError as e:
    raise ValueError(f"{field}={budget!r} is not a budget: {e}") from None


def check_specs(spec_list, budgets, *, block_size: int = 16) -> None:
  """Every spec builds at every budget (``experiments.common.specs``; no model needed)."""
  from experiments.common import specs  # pylint: disable=g-import-not-at-top (imports jax)
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


def check_positions(prompt_tokens: int, new_tokens: int, max_positions: int, *,
                    allow: bool = False, flag: str = "--allow_long_context") -> None:
  """Refuses a run whose positions exceed the model's ``max_position_embeddings``.

  A prompt past the trained context runs (RoPE extrapolates) but silently and for minutes; a
  model whose RoPE scaling allows it is run with ``flag`` (``allow``).

  Args:
    prompt_tokens: the longest prompt, in tokens.
    new_tokens: tokens to generate after it.
    max_positions: the model config's ``max_position_embeddings``.
  """
  need = int(prompt_tokens) + int(new_tokens)
  if need > max_positions and not allow:
    raise ValueError(f"prompt {prompt_tokens} + {new_tokens} new tokens = {need} positions "
                     f"exceed the model's max_position_embeddings {max_positions}; pass {flag} "
                     "to run anyway (RoPE scaling may allow it)")

