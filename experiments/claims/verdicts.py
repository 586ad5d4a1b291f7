"""Verdict rules shared by the claims, and the record filters every verdict depends on.

Verdicts (``VERDICTS``):
  reproduced      the effect has the paper's sign and at least half its size, and our interval
                  excludes no effect (or our number falls in the paper's range);
  partly          the sign and at least half the size, but the interval still includes 0; or
                  one part of a claimed shape (a drop without the rise before it), or a
                  bound missed by less than twice;
  inconclusive    the experiment cannot decide: the interval holds both no effect and the
                  paper's effect, or the setting leaves no room for the effect (no headroom,
                  no gap to close, no knob reaching the target), or the comparison was picked
                  after seeing the data;
  not reproduced  less than half the paper's effect, with the paper's effect outside our
                  interval;
  not comparable  ours measures something else than the paper's number (e.g. one layer
                  against a whole model), so no verdict is given;
  not run         no records yet.

A claim that a method keeps a reference's accuracy ("comparable to dense", "negligible loss")
is judged by ``comparable_verdict``: whether the paired interval rules a loss beyond
``COMPARABLE`` out (reproduced), in (not reproduced), or neither (inconclusive).
"""

from __future__ import annotations

from experiments.claims.row import ROW_FIELDS, Measured

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


COMPARABLE = 0.03  # accuracy within which "comparable" holds (ReSA Table 2 spans -1.8..+1 pts)


def comparable_verdict(lo: float, hi: float, tol: float = COMPARABLE) -> str:
  """The verdict of "the method keeps the reference's accuracy within ``tol``" from the paired
  interval ``[lo, hi]`` of method - reference: reproduced when the interval lies above
  ``-tol`` (a loss beyond ``tol`` is ruled out), not reproduced when it lies below ``-tol`` (a
  loss beyond ``tol`` is certain), inconclusive when it straddles ``-tol``. A gain never
  counts against the claim."""
  if lo >= -tol:
    return "reproduced"
  return "not reproduced" if hi < -tol else "inconclusive"


def ruler_records(records: list[dict]) -> tuple[list[dict], str]:
  """The RULER records of NVIDIA/RULER's generator when there are any, else all of them with
  a note that they come from this library's earlier RULER variant."""
  aligned = [r for r in records if r.get("generator") == RULER_GENERATOR]
  if aligned:
    return aligned, ""
  return records, EARLIER_VARIANT


EARLIER_VARIANT = "earlier RULER variant (fixed depths, own prompts): rerun pending"


def is_dirty(record: dict) -> bool:
  """Whether a record's git revision is ``+dirty`` (it cannot be tied to code)."""
  return str(record.get("git", "")).endswith("+dirty")


def is_declared(record: dict) -> bool:
  """Whether a record's revision was declared (``EXPERIMENT_REVISION``, the GPU sessions)
  rather than read from the checkout that ran: nothing checked that the files that ran are that
  revision's. GPU records from before the ``git_declared`` field (a clean revision on a
  ``gpu`` backend) were all declared that way."""
  if record.get("git_verified") is not None:  # a tree hash was checked: not merely declared
    return False
  if "git_declared" in record:
    return bool(record["git_declared"])
  gpu = record.get("machine", {}).get("backend") == "gpu"
  return gpu and not is_dirty(record) and record.get("git", "unknown") != "unknown"


def is_unverified(record: dict) -> bool:
  """Whether a record's tree hash was checked on the machine that ran it and the files it ran
  were not its revision's (``experiments.common.provenance``)."""
  return record.get("git_verified") is False


# What marks a row: (records of this kind, what the mark calls them).
PROVENANCE = (
    (is_dirty, "are from a modified tree"),
    (is_unverified, "ran files that differ from their declared revision (tree hash checked)"),
    (is_declared, "have a declared revision (EXPERIMENT_REVISION), not one verified against the "
                  "files that ran"),
)
def provenance_note(records: list[dict], measure, got: Measured, flagged, what: str) -> str:
  """A note when ``flagged`` records (``PROVENANCE``) enter a row, else ``""``.

  A record enters the row when leaving it out changes anything the row says: ``measure``
  (records -> ``row.Measured`` or None) is run again without the flagged records and every field of
  ``ROW_FIELDS`` compared with ``got``, the row from every record (a number in ``why``, e.g. a
  variant's score, counts as much as ``ours``); flagged records of the experiment that the row
  does not read (other methods, other lengths) leave no mark.
  """
  count = sum(map(flagged, records))
  if not count:
    return ""
  clean = measure([r for r in records if not flagged(r)])
  if clean is None:
    return f"{count} of the experiment's {len(records)} records {what}; the row rests on them alone"
  changed = [k for k in ROW_FIELDS if getattr(clean, k) != getattr(got, k)]
  if not changed:
    return ""
  return (f"{count} of the experiment's {len(records)} records {what} and change this row's "
          f"{', '.join(changed)} (without them: {clean.ours}, n={clean.n})")


def provenance_notes(records: list[dict], measure, got: Measured) -> list[str]:
  """Every ``PROVENANCE`` note of a row (``provenance_note``)."""
  return [n for flagged, what in PROVENANCE
          if (n := provenance_note(records, measure, got, flagged, what))]
