"""Every experiment, registered once: its entry point, runner, renderer, default runs and claims.

``python -m experiments NAME`` (or the older ``python -m experiments.NAME``) runs
``Experiment.run``; ``experiments.reproduce`` runs every ``Part`` in order; ``experiments.report``
renders each experiment's records with ``Experiment.render``; ``experiments.claims`` measures
each part's ``Claim`` rows. Adding an experiment with a claim row means at least its code (a
module with ``run`` and ``render``), its config ``configs/PART.py``, the claim's measure in
``experiments/claims/`` and one ``Experiment`` here (docs/architecture.md, "Adding an experiment
with a claim row", lists what ``accuracy`` spans).

Runners, renderers and measures are named ``"module:function"`` and imported when used, so
reading the registry (``--help``, a one-line user error, ``reproduce --dry_run``) stays cheap.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Claim:
  """One row of the claims report.

  ``measure(records)`` reads the records of the part's experiment (every workdir's) and returns
  an ``experiments.claims.row.Measured`` (ours, n, setting, verdict, why), or None when they
  hold nothing for the claim.
  ``figure`` is relative to the part's workdir.
  """
  claim: str
  source: str
  paper: str
  figure: str
  measure: str  # "module:function"


@dataclasses.dataclass(frozen=True)
class Part:
  """One default run: config ``configs/NAME.py`` into ``WORKDIR/NAME``."""
  name: str
  minutes: int  # wall time of the default run on an idle 2-core CPU (reproduce's ETA only)
  claims: tuple[Claim, ...] = ()


@dataclasses.dataclass(frozen=True)
class Experiment:
  """An entry point and the records it writes (their ``experiment`` field is ``name``).

  ``run(config, workdir, **options)`` writes ``results.jsonl`` (and the rendered markdown) into
  ``workdir``; it takes ``mesh=`` when ``mesh`` is set and ``allow_long_context=`` when
  ``long_context`` is. ``render(records, workdir)`` writes ``markdown`` and the figures.
  """
  name: str
  run: str  # "module:function"
  render: str  # "module:function"
  markdown: str
  parts: tuple[Part, ...] = ()
  mesh: bool = False
  long_context: bool = False

  def __post_init__(self):
    for ref in (self.run, self.render):
      if ref.count(":") != 1:
        raise ValueError(f"{self.name}: {ref!r} is not 'module:function'")


def load(ref: str) -> Callable:
  """The function a ``"module:function"`` reference names (imported now)."""
  module, _, fn = ref.partition(":")
  return getattr(importlib.import_module(module), fn)


def _fig(name: str) -> str:
  return f"../latency_gpu/{name}"  # GPU rows: records of configs/latency_gpu.py


_TABLE, _SWEEPS = "experiments.claims.table", "experiments.claims.sweeps"
_SPEED, _GEN, _TASKS = ("experiments.claims.speed", "experiments.claims.generation",
                        "experiments.claims.tasks")
_EA = "experiments.claims.compression"
_D25 = "experiments.claims.decoders_2025"

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        "svd_analysis", "experiments.analysis.svd_analysis:run",
        "experiments.analysis.svd_analysis:render_all", "svd_analysis.md",
        (Part("svd_analysis", 15, (
            Claim("principal singular value share of the logits", "RESA Fig. 2b", "40-50%",
                  "fig2b_principal_share_heatmap.png", f"{_TABLE}:principal_share"),
            Claim("sigma_1 linear in context length", "RESA Fig. 2c", "~linear",
                  "fig2c_sigma1_vs_length.png", f"{_TABLE}:sigma1_linear"),
            Claim("mu_Q K^T aligns with sigma_1 u_1 v_1^T", "RESA Fig. 4b", "cos ~1",
                  "fig4b_rank1_cosine.png", f"{_TABLE}:rank1_cosine"),
        )),)),
    Experiment(
        "attention_error", "experiments.analysis.attention_error:run",
        "experiments.analysis.attention_error:render_all", "attention_error.md",
        (Part("attention_error", 20, (
            Claim("score error reduction SA -> SA+RESA", "RESA Fig. 6a / Sec. 1",
                  "55-77% (up to 77%)", "fig6a_error_reduction.png",
                  f"{_TABLE}:score_error_reduction"),
        )),)),
    Experiment(
        "resa_lambda", "experiments.analysis.resa_lambda:run",
        "experiments.analysis.resa_lambda:render_all", "resa_lambda.md",
        (Part("resa_lambda", 60, (
            Claim("accuracy rises with lambda on retrieval (lambda 0 -> 1)",
                  "RESA Fig. 7a (left)", "rising with lambda", "fig7a_lambda_sweep.png",
                  f"{_SWEEPS}:lambda_retrieval_gain"),
            Claim("a large lambda hurts aggregation (CWE)", "RESA Fig. 7a (right)",
                  "rises slightly, then drops", "fig7a_lambda_sweep.png",
                  f"{_SWEEPS}:lambda_aggregation_drop"),
            Claim("a large lambda hurts aggregation (FWE, RULER's other aggregation task)",
                  "RESA Fig. 7a (right)", "rises slightly, then drops (the paper's example: CWE)",
                  "fig7a_lambda_sweep.png", f"{_SWEEPS}:lambda_aggregation_drop_fwe"),
        )),), mesh=True),
    Experiment(
        "budget_reduction", "experiments.analysis.budget_reduction:run",
        "experiments.analysis.budget_reduction:render_all", "budget_reduction.md",
        (Part("budget_reduction", 60, (
            Claim("KV budget reduction within 2 points of dense", "RESA Fig. 7b",
                  "up to 33.2% (PSA), 28.7% (Ada-KV)", "fig7b_budget_reduction.png",
                  f"{_SWEEPS}:budget_reduction"),
            Claim("attention throughput at equal quality", "RESA Fig. 7b (right)",
                  "up to 1.23x PSA, 1.16x Ada-KV", "fig7b_budget_reduction.png",
                  f"{_SWEEPS}:throughput_at_equal_quality"),
        )),), mesh=True),
    Experiment(
        "resa_calibrate", "experiments.analysis.resa_calibrate:run",
        "experiments.analysis.resa_calibrate:render_all", "resa_calibrate.md",
        (Part("resa_calibrate", 20),)),
    Experiment(
        "accuracy", "experiments.tasks.accuracy:run",
        "experiments.tasks.accuracy_report:write_outputs", "accuracy.md",
        (Part("accuracy", 270, (
            Claim("RULER gain of RESA over Quest at 2.5% / 8K", "RESA Table 1",
                  "+4.2 pts (Llama-3.1-8B), +9.0 (Llama-3.2-3B), mean of 7 tasks",
                  "accuracy_vs_length.png", f"{_TASKS}:resa_ruler_gain"),
            Claim("RULER gain of RESA over Quest at 2.5%, lam chosen on held-out tasks",
                  "RESA Table 1 / Fig. 7a", "+4.2 pts (lam tuned per task, not stated for "
                  "Table 1)", "accuracy_vs_length.png",
                  "experiments.claims.held_out:resa_held_out_lam"),
            Claim("RULER gain of RESA over Quest at 2.5%, per-head lam fitted on a novel",
                  "RESA Table 1 / Sec. 5.4", "+4.2 pts (one lam per task in the paper; a lam "
                  "per head is beyond it)", "accuracy_vs_length.png",
                  "experiments.claims.held_out:resa_calibrated_lam"),
            Claim("rectified sparse attention comparable to dense on RULER at sparsity 0.9",
                  "ReSA Table 2", "0.559 vs dense 0.549 (0.531 at 0.95, 0.552 at 0.8)",
                  "accuracy_vs_length.png", f"{_TASKS}:rectified_comparable_to_dense"))),
         Part("accuracy_compression", 690, (
             Claim("Expected Attention beats the training-free eviction baselines at 50% "
                   "(RULER)", "EA Table 1",
                   "above TOVA, SnapKV, KeyDiff at 50% (DuoAttention, trained, beats EA on "
                   "Llama at 50%; at 90% KeyDiff leads)", "accuracy_vs_length.png",
                   f"{_EA}:ea_vs_baselines"),)),
         Part("niah_heatmap", 90, (
             Claim("Expected Attention beats the eviction baselines at 50% (NIAH grid)",
                   "EA Fig. 3", "best of 7 methods", "niah_heatmap.png",
                   f"{_EA}:ea_vs_baselines_niah"),)),
         Part("long_generation_qa", 110, (
             Claim("RetroAttention's long-generation accuracy gain over Quest (b=0.15, w=2)",
                   "Retro Table 1", "+3.9 / +0.5 / +3.5 pts per dataset (mean +2.6, max +6.8)",
                   "accuracy_vs_length.png", f"{_TASKS}:retro_longgen_gain"),)),
         # kvpress's board (no claim rows: its cells are the leaderboard's); minutes estimated
         # from accuracy_compression's rate (one shared prefill a batch; KVzip replays it)
         Part("leaderboard_compression", 600),
         Part("leaderboard_compression_qa", 300),
         # 19 rows x 120 samples at 4k + 8k: estimated from the accuracy part's rate
         Part("leaderboard_sparse", 240, (
             Claim("TidalDecode matches full attention on needle retrieval at ~2.5% of the "
                   "context", "TidalDecode abstract / needle table (README Fig. 3)",
                   "100% at K = 128 and 256 tokens (1.3 / 2.6% of 10K), as full attention; "
                   "Quest 99 / 98% (Llama-3-8B)", "accuracy_vs_length.png",
                   f"{_D25}:tidaldecode_vs_dense"),
             Claim("ShadowKV's selection keeps full attention's RULER accuracy at a small budget",
                   "ShadowKV Table 1 / abstract", "full -> ShadowKV at 1.56% of 128K: 86.68 -> "
                   "86.88 (Llama-3-8B-1M), 85.53 -> 83.57 (Llama-3.1-8B); Quest 82.03 / 76.29",
                   "accuracy_vs_length.png", f"{_D25}:shadowkv_vs_dense"),
             Claim("Twilight (Quest + top-p pruning) nearly lossless on RULER", "Twilight Table 3",
                   "88.18 full -> 86.65 Quest-Twilight (Quest at 8%: 81.62), LLaMA-3.1-8B, "
                   "16k-96k", "accuracy_vs_length.png", f"{_D25}:twilight_vs_dense"),
             Claim("RocketKV's RULER loss negligible at short lengths and low token budgets",
                   "RocketKV Sec. 4.2 / Fig. 5 / Table 2", "negligible at short lengths "
                   "(budgets 256-4096 tokens); NIAH 100.0 = Full-KV at 256 tokens (Llama3.1-8B)",
                   "accuracy_vs_length.png", f"{_D25}:rocketkv_vs_dense"),
         ))),
        mesh=True, long_context=True),
    Experiment(
        "needle_keep", "experiments.analysis.needle_keep:run",
        "experiments.analysis.needle_keep:render_all", "needle_keep.md",
        (Part("needle_keep", 10),)),
    Experiment(
        "ea_needle_diagnosis", "experiments.analysis.ea_needle_diagnosis:run",
        "experiments.analysis.ea_needle_diagnosis:render_all", "ea_needle_diagnosis.md"),
    Experiment(
        "perplexity", "experiments.tasks.perplexity:run",
        "experiments.tasks.perplexity:write_outputs", "perplexity.md",
        (Part("perplexity", 70, (
            Claim("ReSA rectification (f=32) closes the perplexity gap", "ReSA Fig. 4",
                  "near the decode-only bound", "perplexity_sweeps.png",
                  f"{_GEN}:rectification_closes_gap"),
        )),), mesh=True),
    Experiment(
        "long_generation", "experiments.tasks.long_generation:run",
        "experiments.tasks.long_generation:write_outputs", "long_generation.md",
        (Part("long_generation", 60, (
            Claim("RetroAttention effective KV budget", "Retro Fig. 2c",
                  "1.17x (w=2) to 1.60x (w=8)", "long_generation.png",
                  f"{_GEN}:retro_effective_budget"),
        )),), mesh=True),
    Experiment(
        "latency", "experiments.latency_lib.runner:run", "experiments.latency_lib.report:write",
        "latency.md",
        (Part("latency", 12, (
            Claim("RESA decode overhead per step", "RESA Table 4", "<= 3.13%", "latency.png",
                  f"{_SPEED}:resa_decode_overhead"),
            Claim("RESA decode overhead per step, GPU", "RESA Table 4", "<= 3.13%",
                  _fig("latency.png"), f"{_SPEED}:resa_decode_overhead_gpu"),
            Claim("RESA prefill overhead, last chunk", "RESA Table 3", "4.8-7.4%",
                  "latency.png", f"{_SPEED}:resa_prefill_overhead"),
            Claim("RESA prefill overhead, last chunk, GPU", "RESA Table 3", "4.8-7.4%",
                  _fig("latency.png"), f"{_SPEED}:resa_prefill_overhead_gpu"),
            Claim("ReSA memory access 1/b + p + 1/f of dense", "ReSA Sec. 2.3",
                  "0.194 (b=16, p=0.1, f=32)", "latency.png",
                  f"{_SPEED}:rectified_memory_access"),
            Claim("ReSA memory access 1/b + p + 1/f of dense, GPU", "ReSA Sec. 2.3",
                  "0.194 (b=16, p=0.1, f=32)", _fig("latency.png"),
                  f"{_SPEED}:rectified_memory_access_gpu"),
            Claim("RetroAttention throughput loss (w=8, worst case)", "Retro Table 6",
                  "<= 7.3%", "latency.png", f"{_SPEED}:retro_throughput_loss"),
            Claim("RetroAttention throughput loss (w=8, worst case), GPU", "Retro Table 6",
                  "<= 7.3%", _fig("latency.png"), f"{_SPEED}:retro_throughput_loss_gpu"),
            Claim("ReSA kernel-level breakdown: estimation, attention, rectification, GPU",
                  "ReSA Fig. 6", "estimation ~ attention; rectification 16.6% (64k) / 14.0% "
                  "(256k) of the attention latency", "latency.md",
                  f"{_SPEED}_e2e:resa_fig6"),
            Claim("ReSA end-to-end decode speed-up over dense (up to 3.77x at 256K), GPU",
                  "ReSA Fig. 7", "up to 3.77x at 256K (abstract, Sec. 3.4.2); 2.42x "
                  "(conclusion); Qwen-3 1.7B, H100", "latency.md",
                  f"{_SPEED}_e2e:resa_fig7"),
            Claim("Expected Attention at 50% halves the KV cache", "EA Fig. 5a / Sec. 4.3",
                  "2x less KV memory", "latency.png", f"{_SPEED}:ea_memory"),
        )),)),
)


def by_name(experiments=EXPERIMENTS) -> dict[str, Experiment]:
  return {e.name: e for e in experiments}


def get(name: str, experiments=EXPERIMENTS) -> Experiment:
  """The experiment called ``name``; an unknown name is a ValueError listing the known ones."""
  found = by_name(experiments)
  if name not in found:
    raise ValueError(f"unknown experiment {name!r}; known: {sorted(found)}")
  return found[name]


def parts(experiments=EXPERIMENTS) -> list[tuple[Part, Experiment]]:
  """Every default run in order, with the experiment that runs it."""
  return [(p, e) for e in experiments for p in e.parts]


def claims(experiments=EXPERIMENTS) -> list[tuple[Claim, Part, Experiment]]:
  """Every claim row in report order (the parts' order)."""
  return [(c, p, e) for p, e in parts(experiments) for c in p.claims]
