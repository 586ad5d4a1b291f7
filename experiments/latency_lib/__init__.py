"""Decode-latency and memory benchmark (issue 9), called by ``experiments/latency.py``.

Modules: ``settings`` (config -> sizes, quick mode), ``timing`` (interleaved medians),
``traffic`` (memory-traffic bound per method), ``per_layer`` (Llama-8B attention + torch SDPA),
``end_to_end`` (SmolLM2 vs transformers), ``memory`` (cache bytes, peak RSS per subprocess),
``resa_overhead`` (RESA's prefill/decode overheads), ``prefill`` (dense prefill vs
transformers on the same weights), ``report`` (markdown + PNG).
"""

from experiments.latency_lib.runner import run

__all__ = ["run"]
