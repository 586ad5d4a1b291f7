"""Decode-latency and memory benchmark (issue 9), called by ``experiments/latency.py``.

Modules: ``settings`` (config -> sizes, quick mode), ``timing`` (interleaved medians),
``traffic`` (memory-traffic bound per method), ``per_layer`` (Llama-8B attention + torch SDPA),
``end_to_end`` (SmolLM2 vs transformers), ``memory`` (cache bytes, peak RSS per subprocess),
``resa_overhead`` (RESA's prefill/decode overheads), ``prefill`` (dense prefill vs
transformers on the same weights), ``shape_e2e`` (a named Hugging Face shape with random
weights end to end, ours in ``shape_ours`` and ``transformers`` in ``shape_peer``, bytes and
shapes in ``shapes``), ``report`` (markdown + PNG).
"""


def run(config, workdir: str) -> str:
  """``runner.run``, imported on use: the section's child processes import this package and
  need none of the runner's flags and config machinery."""
  from experiments.latency_lib import runner  # pylint: disable=g-import-not-at-top
  return runner.run(config, workdir)


__all__ = ["run"]
