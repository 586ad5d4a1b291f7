"""What a model run hands a method's layer state before the prompt: the ``layer_state`` hook.

Most methods need nothing but q, k, v, the cache and their own state. A few need one more
thing that only the run knows, each fixed before the prompt's prefill:

* of the model, per layer: CriticalKV's output projection ``W^O`` (``out_proj``);
* of the sample, per row: FINCH's question, the last ``question_length`` prompt tokens;
* of a calibration (a table the method carries, computed once per model by
  ``experiments.common.calibration.calibrate``): Q-Filters' filters, DuoAttention's
  streaming heads; these read only the layer index.

One hook serves them all: a method may define ``layer_state(state, layer, inputs=None) ->
state``, which ``models.steps.init_caches`` calls on each layer's fresh state with the layer
index and that layer's ``LayerInputs``. A field the run does not know is None, and the method
then keeps its documented fallback (``W^O`` = identity, the question = its window).

A method that buffers the question in a static state shape (FINCH's query ring) is sized for
the run's longest question before its states exist: ``sized_for(method, n)`` (its
``with_question_room``); its hook refuses a longer question rather than observe part of it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class LayerInputs:
  """One layer's run inputs (``layer_state``'s third argument).

  Attributes:
    out_proj: ``[N D, E]`` the layer's output projection as stored (Flax ``o_proj`` kernel:
      rows read query head ``h``'s ``D`` channels), or None.
    question_length: ``[B]`` int32: row ``b``'s prompt ends with its question of this many
      tokens (the query-aware protocol: prompt = context + question), or None (not known).
  """

  out_proj: jax.Array | None = None
  question_length: jax.Array | None = None


def sized_for(method, question_length):
  """``method`` able to observe a question of ``question_length`` tokens (an int or ``[B]``:
  the longest counts; None: unchanged): its ``with_question_room(n)`` if it has one (FINCH),
  else ``method`` itself."""
  room = getattr(method, "with_question_room", None)
  if room is None or question_length is None or not np.size(question_length):
    return method
  return room(int(np.max(question_length)))


def apply(method, states, inputs):
  """``states`` (per-layer list) after ``method.layer_state``, if the method has one.

  Args:
    inputs: per-layer list of ``LayerInputs`` (or None: nothing known).
  """
  hook = getattr(method, "layer_state", None)
  if hook is None:
    return states
  inputs = inputs or [LayerInputs()] * len(states)
  return [hook(s, i, x) for i, (s, x) in enumerate(zip(states, inputs, strict=True))]
