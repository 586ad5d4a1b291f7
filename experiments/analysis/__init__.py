"""Shared analysis code for the RESA / ReSA analysis experiments.

``capture`` (per-layer post-RoPE q/k/v of a real text), ``svd`` (spectra of attention logits,
RESA Sec. 3.2), ``errors`` (per-layer attention error of a method vs dense, RESA Sec. 5.3),
``quality`` (teacher-forced NLL tasks), ``calibrate`` (per-head RESA lambda fitting).
Entry points in ``experiments/`` only parse flags and call these.
"""
