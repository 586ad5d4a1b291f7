"""What a claim's measure returns: ``Measured``, our side of one row of the claims table.

A measure (``measure(records)``, registered with its claim in ``experiments.registry``) returns
a ``Measured`` or None when the records hold nothing for the claim; ``report.claim_rows`` puts
the claim's own columns (claim, source, paper, figure) beside its ``columns()``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Measured:
  """Our number for one claim.

  Attributes:
    ours: our number, with its interval where it has one.
    n: the sample count behind it.
    setting: model, lengths, budget ... of the records it reads.
    verdict: one of ``verdicts.VERDICTS``.
    why: what else the records say (variants, other lengths, the verdict's reason).
    read: the records the row rests on, when a measure says (the report then links the figure
      of the folder holding most of them); not part of the row's text.
  """

  ours: str
  n: int
  setting: str
  verdict: str
  why: str
  read: list | None = dataclasses.field(default=None, compare=False, repr=False)

  def columns(self) -> dict:
    """The row's columns as the claims table prints them (``ROW_FIELDS``: without ``read``)."""
    return {f: getattr(self, f) for f in ROW_FIELDS}

  def plus(self, *, setting: str = "", why: str = "", **changes) -> Measured:
    """This row with ``setting`` and ``why`` appended to and ``changes`` replaced."""
    return dataclasses.replace(self, setting=self.setting + setting, why=self.why + why,
                               **changes)


ROW_FIELDS = tuple(f.name for f in dataclasses.fields(Measured) if f.name != "read")
