"""The main job's printout (``experiments.generate``): both answers side by side, then per
method the share of the prompt it attends, tokens/s and, on the default prompt, whether it
answered right; warnings where a method is dense, notes where a sparse one is slower.
"""

from __future__ import annotations

import textwrap

from experiments.common import passage, sparsity


def side_by_side(left_title, left, right_title, right, width) -> str:
  """Two texts in columns of ``width`` characters, each under its title."""
  wrap = lambda s: sum((textwrap.wrap(p, width) or [""] for p in s.split("\n")), [])
  a, b = [left_title, "-" * width] + wrap(left), [right_title, "-" * width] + wrap(right)
  a += [""] * (len(b) - len(a))
  b += [""] * (len(a) - len(b))
  return "\n".join(f"{x:<{width}} | {y}" for x, y in zip(a, b))


def verdict(label: str, texts: dict, right: dict | None) -> str:
  """The last line: whether ``label``'s text equals dense's and, for the default prompt, whether
  each answered the planted question right."""
  same = "gives the same text as" if texts["dense"] == texts[label] else "differs from"
  if right is None:
    return f"{label} {same} dense."
  word = lambda name: "right" if right[name] else "wrong"
  return (f"{label} {same} dense; the planted password is {passage.ANSWER!r}: dense answers "
          f"{word('dense')}, {label} answers {word(label)}.")


def report(results, built, context: int, *, right=None, cache_share=None,
           num_layers: int | None = None) -> str:
  """Per method: the share of the prompt it attends, tokens/s, new tokens; then warnings.

  Args:
    results: ``name -> models.Generation`` (dense first).
    built: ``name -> Method`` (the same names).
    context: the prompt's tokens.
    right: ``name -> bool``, whether its answer is right (an "answer" column), or None.
    cache_share: the KV cache's share of a decode step's bytes (``sparsity.cache_share``): a
      note says it where a sparse method decodes slower than dense.
    num_layers: the model's decoder layers (a method with dense layers: the mean over them).
  """
  width = max(len("method"), *map(len, results)) + 2  # long specs keep the columns aligned
  answer = f"{'answer':>8}" if right else ""
  lines = [f"{'method':<{width}}{'prefill tok/s':>14}{'decode tok/s':>14}{'new tokens':>12}"
           f"{answer}  attends per head (share of the prompt)"]
  notes = []
  base = results.get("dense")
  for name, g in results.items():
    att = sparsity.attended(built[name], context, num_layers)
    answer = f"{'right' if right[name] else 'wrong':>8}" if right else ""
    lines.append(f"{name:<{width}}{g.prefill_tokens_per_second:>14.1f}"
                 f"{g.decode_tokens_per_second:>14.2f}{len(g.tokens[0]):>12}{answer}  "
                 f"{att.describe()}")
    notes.append(sparsity.dense_warning(name, att))
    if base is None or built[name].is_dense:
      continue
    if g.prefill_tokens_per_second < base.prefill_tokens_per_second:
      notes.append(f"note: {name} prefills slower than dense: it reads the whole prompt as dense "
                   "does, plus its own bookkeeping (block digests, or the scores it evicts by)")
    if (cache_share is not None and att.tokens < att.context  # a dense one has its warning
        and g.decode_tokens_per_second < base.decode_tokens_per_second):
      notes.append(f"note: {name} decodes slower than dense here: at {context} tokens the KV "
                   f"cache is {100 * cache_share:.0f}% of the bytes a decode step reads (the "
                   "weights are the rest), so attending less of it saves little while choosing "
                   "blocks costs a few small ops per layer; the gain grows with the context "
                   "(docs/results.md, SmolLM2 end to end)")
  return "\n".join(lines + [n for n in notes if n])
