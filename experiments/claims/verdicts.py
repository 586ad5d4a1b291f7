"""Verdict rules shared by the claims, and the record filters every verdict depends on.

Verdicts (``VERDICTS``):
  reproduced      the effect has the paper's sign and at least half its size, and our interval
                  excludes no effect (or our number falls in the paper's range);
  partly          the sign and at least half the size, but the interval still includes 0;
  inconclusive    the experiment cannot decide: the interval holds both no effect and the
                  paper's effect, or the setting leaves no room for the effect (no headroom,
                  no gap to close, no knob reaching the target), or the comparison was picked
                  after seeing the data;
  not reproduced  less than half the paper's effect, with the paper's effect outside our
                  interval;
  not comparable  ours measures something else than the paper's number (e.g. one layer
                  against a whole model), so no verdict is given;
  not run         no records yet.
"""

from __future__ import annotations

VERDICTS = ("reproduced", "partly", "inconclusive", "not reproduced", "not comparable",
            "not run")
RULER_GENERATOR = "nvidia-ruler"  # experiments.tasks.ruler.GENERATOR (no jax import here)


def effect_verdict(d: float, lo: float, hi: float, paper: float) -> str:
  """The verdict of a paired effect ``d [lo, hi]`` against the paper's effect ``paper``
  (same units, positive: the paper's direction)."""
  if paper <= 0:
    raise ValueError(f"the paper's effect must be positive, got {paper}")
  if d >= paper / 2:
    return "reproduced" if lo > 0 else "partly"
  if hi >= paper:  # our interval still holds the paper's effect: too few samples to reject it
    return "inconclusive"
  return "not reproduced"


def ruler_records(records: list[dict]) -> tuple[list[dict], str]:
  """The RULER records of NVIDIA/RULER's generator when there are any, else all of them with
  a note that they come from this library's earlier RULER variant."""
  aligned = [r for r in records if r.get("generator") == RULER_GENERATOR]
  if aligned:
    return aligned, ""
  return records, "earlier RULER variant (fixed depths, own prompts): rerun pending"


def is_dirty(record: dict) -> bool:
  """Whether a record's git revision is ``+dirty`` (it cannot be tied to code)."""
  return str(record.get("git", "")).endswith("+dirty")


def dirty_note(records: list[dict], measure, got: dict) -> str:
  """A note when records from a modified tree enter a row, else ``""``.

  A record enters the row when leaving it out changes what the row says: ``measure`` (records
  -> row dict or None) is run again on the clean records only and its ``ours`` / ``n`` /
  ``verdict`` compared with ``got``, the row from every record; dirty records of the experiment that the row does not read (other
  methods, other lengths) leave no mark.
  """
  dirty = sum(map(is_dirty, records))
  if not dirty:
    return ""
  clean = measure([r for r in records if not is_dirty(r)])
  same = clean is not None and all(clean.get(k) == got.get(k) for k in ("ours", "n", "verdict"))
  if same:
    return ""
  without = (f"without them: {clean['ours']}, n={clean['n']}" if clean is not None
             else "nothing without them")
  return (f"{dirty} of the experiment's {len(records)} records are from a modified tree and "
          f"change this row ({without})")
