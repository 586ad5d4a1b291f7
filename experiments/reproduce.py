r"""Runs every experiment's default config in order, then renders the reproduction report.

  python -m experiments.reproduce --workdir=results                 # everything (~hours)
  python -m experiments.reproduce --workdir=results --only=svd_analysis,attention_error
  python -m experiments.reproduce --workdir=results --dry_run       # the plan and its ETA

The parts are ``experiments.registry``'s, in its order. Each is ``python -m experiments NAME
--config=configs/PART.py --workdir=WORKDIR/PART`` in its own process (experiments resume from
their ``results.jsonl``, so an interrupted run picks up where it stopped). A progress line with
the elapsed time and an ETA (from each part's expected minutes, measured on a 2-core CPU, scaled
by how the finished parts compared with their estimate) is printed before
and after every part; each part's wall time is appended to ``WORKDIR/timings.jsonl`` and the
report (``experiments.claims``) is rebuilt at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from experiments import registry

FLAGS = flags.FLAGS


def define_flags():
  """The command line (defined only when run as a script, so the module imports cleanly)."""
  flags.DEFINE_string("workdir", "results", "Root of the per-experiment workdirs.")
  flags.DEFINE_list("only", [], "Run only these parts (names from experiments.registry).")
  flags.DEFINE_list("skip", [], "Skip these parts.")
  flags.DEFINE_bool("dry_run", False, "Print the plan and its ETA, run nothing.")
  flags.DEFINE_bool("report", True, "Rebuild the report at the end.")


def plan(only=(), skip=(), experiments=registry.EXPERIMENTS) -> list[tuple[str, str]]:
  """``(part, experiment)`` to run, in order; unknown names are a usage error naming the valid
  ones."""
  every = [(p.name, e.name) for p, e in registry.parts(experiments)]
  names = [n for n, _ in every]
  bad = sorted((set(only) | set(skip)) - set(names))
  if bad:
    raise app.UsageError(f"unknown part(s) {bad}; valid: {names}")
  return [(n, a) for n, a in every if (not only or n in only) and n not in skip]


def command(part: str, experiment: str, workdir: str) -> list[str]:
  return [sys.executable, "-m", "experiments", experiment, f"--config=configs/{part}.py",
          f"--workdir={os.path.join(workdir, part)}"]


def eta_line(i: int, parts, elapsed: float, spent: dict,
             experiments=registry.EXPERIMENTS) -> str:
  """``[i/n] elapsed, eta`` with the remaining estimate scaled by finished parts' speed."""
  minutes = {p.name: p.minutes for p, _ in registry.parts(experiments)}
  done_est = sum(minutes[n] for n in spent) * 60
  speed = (sum(spent.values()) / done_est) if done_est else 1.0
  left = sum(minutes[n] for n, _ in parts[i:]) * 60 * speed
  return f"[{i}/{len(parts)}] elapsed {elapsed / 60:.1f} min, eta {left / 60:.1f} min"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  parts = plan(FLAGS.only, FLAGS.skip)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  start, spent, failed = time.time(), {}, []
  print(eta_line(0, parts, 0.0, spent), "plan:", ", ".join(n for n, _ in parts), flush=True)
  for i, (name, experiment) in enumerate(parts):
    cmd = command(name, experiment, FLAGS.workdir)
    print(f"==> {name}: {' '.join(cmd[1:])}", flush=True)
    if FLAGS.dry_run:
      continue
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=root)
    spent[name] = time.time() - t0
    os.makedirs(FLAGS.workdir, exist_ok=True)
    with open(os.path.join(FLAGS.workdir, "timings.jsonl"), "a", encoding="utf-8") as f:
      f.write(json.dumps(dict(part=name, seconds=round(spent[name], 1), rc=rc,
                              finished=time.strftime("%Y-%m-%dT%H:%M:%S"))) + "\n")
    if rc:
      failed.append(name)
    print(f"<== {name}: rc={rc} in {spent[name] / 60:.1f} min; "
          + eta_line(i + 1, parts, time.time() - start, spent), flush=True)
  if FLAGS.report and not FLAGS.dry_run:
    subprocess.call([sys.executable, "-m", "experiments.claims", f"--workdir={FLAGS.workdir}"],
                    cwd=root)
  if failed:
    print(f"failed parts: {failed}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
