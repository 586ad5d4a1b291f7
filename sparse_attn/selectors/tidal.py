"""TidalDecode (Yang et al., ICLR 2025, arXiv 2410.05076): position-persistent sparse attention.

Consecutive layers attend to largely the same tokens ("spatial coherence", Sec. 3.1), so
TidalDecode chooses tokens in a few *token selection layers* only and lets every other layer
read the positions chosen there (Sec. 3.2, Algorithm 1). During decoding, for layer ``l`` of
``L``:

* ``l < sparse_start`` (layers 0 and 1): full attention;
* ``l == sparse_start`` (layer 2) and ``l == reselect`` (the "token re-selection" layer, 13 for
  Llama-3-8B; Sec. 3.2, Fig. 3 "TD+L13"): full attention, and the top-``k`` tokens of this
  layer's attention scores ``q . K^T / sqrt(D)`` per query head are recorded
  (Eq. 3: ``I = argtopk_k(q K^T)``);
* every other layer: sparse attention of its own ``q`` over its own keys and values at the
  recorded positions only, ``softmax(q K_I^T / sqrt(D)) V_I`` (Eq. 4), ``I`` the latest
  selection layer's.

The prefill is full attention in every layer. Defaults, read from the authors' code
(github DerrickYLJ/TidalDecode, commit d67a1bd): ``sparse_start=2`` and ``reselect=13``
(``src/enable_tidal.py`` lines 1-4, ``examples/run_tidal_llama.sh``); the token budget ``k``
is a token count there (``TOP_K=128``; 256 to 4096 in the paper's tables), any ``Budget`` here.
The selection is per query head (``src/tidal_build/modify_llama.py`` lines 79-125: the keys are
repeated per head, ``torch.topk`` over the last axis of ``[B, Hq, 1, T]`` scores) over every
cached token, the current one included, with no forced sinks or local window: this selector's
budget defaults to ``n_sink=0, local_window=0`` (the library's ``Budget`` forces 4 sinks + 64
recent tokens otherwise; pass them to get that). The authors' fused kernel
(``tidal/utils/controller.py``) instead keeps the newest token always and ranks the rest:
``local_window=1, forced_count="inside"`` gives that variant. ``gqa="group"`` ranks by the
group's mean logit (one list per kv head).

Measured (``results/tidaldecode_forced``, Qwen2.5-Coder-0.5B, RULER single needles at 4k, 2.5%):
without forced tokens the answer breaks off or loops (0 of 10 right; re-selection at layer 6,
18 or none: 1, 0, 0 of 10), with ``n_sink=4, local_window=64`` 5 of 10 (dense 10 of 10). The
fused kernel's variant (``results/tidaldecode_newest``: the newest token always kept) is 0 of
10 too, with the same answers: the number starts right and stops after a few digits
(``811131.`` for 8111318), the digits generated just before not being among the chosen
tokens; a local window of recent tokens is what brings answers back.

The cross-layer part lives in ``sparse_attn.tidal.TidalMethod`` (what ``methods.make`` builds
for this selector): the decode loop (``models.steps``) hands the selection layer's choice to
the following layers. On its own (``select``) this selector is what a selection layer chooses:
the exact token top-k of ``sparse_attn.selection.topk``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pallas_kernels import Impl
from sparse_attn import placement, selection
from sparse_attn.budget import Budget
from sparse_attn.selectors.base import Selector


@dataclasses.dataclass(frozen=True)
class TidalDecode(Selector):
  """TidalDecode's token selection (see the module docstring).

  Attributes (besides ``budget``, ``block_size``, ``gqa``):
    sparse_start: the first token-selection layer; the layers before it attend densely.
    reselect: the token re-selection layer (None or -1: none); must come after
      ``sparse_start``.
  """

  sparse_start: int = 2
  reselect: int | None = 13

  name: ClassVar[str] = "tidaldecode"
  token_level: ClassVar[bool] = True
  # The paper's protocol: no forced tokens (``selectors.build`` fills these in when not given).
  budget_defaults: ClassVar[dict] = dict(n_sink=0, local_window=0)

  def __post_init__(self):
    if self.budget is not None and not isinstance(self.budget, Budget):
      object.__setattr__(self, "budget", Budget(budget=self.budget, **self.budget_defaults))
    super().__post_init__()
    if self.reselect is not None and int(self.reselect) < 0:
      object.__setattr__(self, "reselect", None)
    start = self.sparse_start
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
      raise ValueError(f"sparse_start must be an int >= 0, got {start!r}")
    if self.reselect is not None and not (isinstance(self.reselect, int)
                                          and self.reselect > start):
      raise ValueError(f"reselect must be a layer after sparse_start={start} (or None), got "
                       f"{self.reselect!r}")

  @property
  def method_class(self):
    """The ``methods.Method`` subclass that decodes with this selector: the layer roles."""
    from sparse_attn.tidal import TidalMethod  # pylint: disable=g-import-not-at-top
    return TidalMethod

  def role(self, layer: int) -> str:
    """``"dense"``, ``"select"`` or ``"reuse"``: what decoder layer ``layer`` does."""
    if layer < self.sparse_start:
      return "dense"
    return "select" if layer in (self.sparse_start, self.reselect) else "reuse"

  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False, place=placement.ONE_DEVICE) -> selection.Selection:
    """A selection layer's choice: the top tokens of ``q [B, Hq, D]``'s exact logits."""
    del impl, interpret, windowed, place  # a windowed view holds no out-of-window key
    return selection.topk(q, cache, self.budget, self.gqa, scale)
