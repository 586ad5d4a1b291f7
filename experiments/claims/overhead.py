"""The verdict rule of an overhead claim ("adds at most X%"), shared by the per-layer and the
end-to-end speed rows."""

import numpy as np


def overhead_verdict(rows, limit: float) -> str:
  """The verdict of "the overhead is <= ``limit`` at every context" from per-context
  ``(context, mean, lo, hi, ...)``: reproduced when every interval lies at or below the limit;
  not reproduced when one lies wholly above twice the limit; partly when one lies wholly above
  the limit (none above twice it); inconclusive when an interval holds the limit (too noisy to
  tell, wherever its mean falls). A context without an interval (NaN bounds) counts its mean."""
  bounds = [(m, m) if not np.isfinite(lo) else (lo, hi) for _, m, lo, hi, *_ in rows]
  if all(hi <= limit for _, hi in bounds):
    return "reproduced"
  if any(lo > 2 * limit for lo, _ in bounds):
    return "not reproduced"
  if any(lo > limit for lo, _ in bounds):
    return "partly"
  return "inconclusive"
