r"""Q-Filters' kept tokens against kvpress 0.5.5's ``QFilterPress`` on SmolLM2 (outside CI).

  python -m experiments.kvpress_parity_qfilters --kvpress_path=/tmp/kvp --length=2048 --ratio=0.5

kvpress's ``QFilterPress`` downloads the authors' filters from the Hugging Face hub
(``nthngdy/<model>_qfilt``), which cannot be reached here.
So kvpress is given OUR filters: its ``load_q_filters`` is replaced by one returning our
calibrated ``[L, K, D]`` table (``experiments.common.calibration.qfilters``: the query SVD of
4,096 Austen tokens, 3,000 queries per head, as the authors' ``make_filters.py``), the layout of
kvpress's ``QFilters.q_filters`` parameter, and its ``post_init_from_model`` runs as it would on
a model. The comparison therefore checks the scoring and the selection given identical filters,
not the calibration.

The post-RoPE keys of the essays are captured once (a dense prefill, as
``experiments.kvpress_parity``); per layer, ours (``methods.make("qfilters")`` with the table,
the layer's row from ``layer_state``, as the model's ``init_caches`` gives it; then
``kvpress_parity.ours_kept``) and kvpress's ``press.score`` (a stand-in module carrying
``layer_idx``, its top ``compute_n_kept`` per head) on the same keys. Printed: min / mean
overlap ``|ours & theirs| / max(|ours|, |theirs|)`` over layers x kv heads and the share of
identical cells.

Scoring details against kvpress and the authors: both score ``-<f, k>`` on post-RoPE keys and
keep the highest; the filter of a kv head is the mean over its query-head group (consecutive
heads ``h // G``) of ``-sign_h v_1`` with ``sign_h = +1`` when most of ``U[:, 0]`` is positive
(the authors' ``make_filters.py``); neither keeps sinks. No difference found.

Measured 2026-11-28 (2,048 tokens of the essays, ratio 0.5, 30 layers x 3 kv heads):
min / mean overlap 1.0000 / 1.0000, every cell identical (again on 2026-11-29 with the overlap
over the larger set, ``kept_overlap.overlap``).
"""

from __future__ import annotations

import types

from absl import app, flags
import numpy as np

from experiments import kvpress_parity
from experiments.common import calibration, capture, kept_overlap, modelzoo, peer_kvpress
from sparse_attn import methods

FLAGS = flags.FLAGS


class AtLayer:
  """``method`` as layer ``layer`` of the model sees it: its state carries the layer's filter
  row (``layer_state``), everything else is the method's."""

  def __init__(self, method, layer: int):
    self._method, self._layer = method, layer

  def __getattr__(self, name):
    return getattr(self._method, name)

  def init_state(self, *args, **kwargs):
    return self._method.layer_state(self._method.init_state(*args, **kwargs), self._layer)


def kvpress_press(kvpress, table, ratio):
  """kvpress's ``QFilterPress`` at ``ratio`` whose filters are ``table [L, K, D]`` (its hub
  download replaced by the table, in the layout of ``QFilters.q_filters``)."""
  import torch  # pylint: disable=g-import-not-at-top
  cls = kvpress.QFilterPress
  cls.load_q_filters = staticmethod(lambda model_name: torch.from_numpy(np.array(table)))
  press = cls(compression_ratio=ratio)
  model = types.SimpleNamespace(config=types.SimpleNamespace(name_or_path="SmolLM2-135M-Instruct"),
                                dtype=torch.float32)
  press.post_init_from_model(model)
  return press


def theirs_kept(press, kvpress, layer, k, v, ratio) -> np.ndarray:
  """``[K, S]`` bool: the top ``compute_n_kept`` of kvpress's scores per kv head."""
  import torch  # pylint: disable=g-import-not-at-top
  kt, vt = (torch.from_numpy(np.array(x, np.float32))[None] for x in (k, v))
  scores = press.score(types.SimpleNamespace(layer_idx=layer), None, kt, vt, None, {})
  n = kvpress.utils.compute_n_kept(k.shape[1], ratio)
  kept = np.zeros(k.shape[:2], bool)
  np.put_along_axis(kept, scores.topk(n, dim=-1).indices[0].numpy(), True, axis=-1)
  return kept


def main(argv):
  del argv
  kvpress = peer_kvpress.load(FLAGS.kvpress_path)
  model = modelzoo.load_model("smollm2-135m-instruct")
  table = calibration.qfilters(model)
  cap = capture.capture(model, capture.text_tokens(model, FLAGS.text, FLAGS.length))
  m = methods.make("qfilters", ratio=FLAGS.ratio).with_filters(table)
  press = kvpress_press(kvpress, table, FLAGS.ratio)
  o = kept_overlap.per_layer(cap.num_layers, lambda layer: (
      kvpress_parity.ours_kept(AtLayer(m, layer), cap.k[layer], cap.v[layer], FLAGS.ratio),
      theirs_kept(press, kvpress, layer, cap.k[layer], cap.v[layer], FLAGS.ratio)))
  print(f"SmolLM2-135M, {FLAGS.length} tokens of {FLAGS.text!r}, ratio {FLAGS.ratio}, "
        f"kvpress {kvpress.version}, our filters (Austen query SVD) on both sides")
  print(kept_overlap.TABLE_HEAD)
  print(kept_overlap.table_row("qfilters", "QFilterPress", o))

if __name__ == "__main__":
  kvpress_parity.define_flags()
  app.run(main)
