"""Synthetic accuracy records for the claim tests: one record per score, seeds 0..n-1."""


def accuracy_records(method, scores, *, task="niah_single_2", length=4096, budget=0.025,
                     protocol="query_aware", **extra):
  """``len(scores)`` accuracy records of ``method`` on ``task``, paired across methods by seed."""
  return [dict(experiment="accuracy", model="m", method=method, budget=budget, length=length,
               protocol=protocol, task=task, seed=i, depth=0.5, score=float(s), **extra)
          for i, s in enumerate(scores)]


def acc(method, scores, budget=0.025, length=4096, protocol="query_aware", task="niah_single_2"):
  """``accuracy_records`` with the budget, length and protocol positional (the claim tests'
  short form)."""
  return accuracy_records(method, scores, task=task, length=length, budget=budget,
                          protocol=protocol)
