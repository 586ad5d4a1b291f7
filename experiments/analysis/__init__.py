"""The RESA / ReSA / EA analysis experiments, one module per experiment plus the math they share.

Experiments (each a ``run(config, workdir)`` and a ``render_all(records, workdir)``, registered
in ``experiments.registry``): ``svd_analysis``, ``attention_error``, ``resa_lambda``,
``budget_reduction``, ``resa_calibrate``, ``needle_keep``, ``ea_needle_diagnosis``.

Math and data they share, pure functions tested on their own: ``capture`` (per-layer post-RoPE
q/k/v of a real text), ``svd`` (spectra of attention logits, RESA Sec. 3.2), ``errors``
(per-layer attention error of a method vs dense, RESA Sec. 5.3), ``resa_decomposition`` (where
RESA's error comes from), ``quality`` (teacher-forced NLL tasks), ``calibrate`` (per-head RESA
lambda fitting), ``kept_tokens`` (which prompt tokens a compression method keeps).
"""
