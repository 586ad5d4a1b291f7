"""``python -m experiments NAME [flags]``: every experiment and tool of the README, one form.

A registered experiment (``experiments.registry``) runs through ``experiments.entry``; a tool
(``TOOLS``: the main job, the report, reproduce, claims, ...) runs its own module as
``python -m experiments.NAME`` would. ``python -m experiments`` alone lists both.
"""

import runpy
import sys

from experiments import entry, registry

# Entry points that are not registered experiments: name -> what it does.
TOOLS = {
    "generate": "the main job: a sparse method next to dense on a bundled prompt",
    "report": "one markdown report of every results.jsonl under --workdir",
    "reproduce": "every default config in order, resumable, then claims",
    "claims": "REPORT.md: each paper claim, the paper's number, ours, a verdict",
    "merge": "merges workdirs of one config: --into=results/NAME WORKDIR...",
    "memory_plan": "docs/sharding.md: Llama-3.1-8B's memory plan per mesh layout",
    "shard_memory": "per-device cache bytes of a sharded decode",
    "load_memory": "peak host memory of a bf16 checkpoint load against its size",
    "ruler_throughput": "RULER samples per hour at 32k on a GPU, ours next to kvpress",
    "ptx_steps": "registers and spills of each decode step's Triton launches for sm_90 (ptx extra)",
}


def _usage() -> str:
  rows = [f"  {e.name:<22} configs: {', '.join(p.name for p in e.parts) or e.name}"
          for e in registry.EXPERIMENTS]
  tools = [f"  {name:<22} {what}" for name, what in TOOLS.items()]
  return ("usage: python -m experiments NAME [--config=...] [--workdir=...]   (NAME --help: its "
          "flags)\nexperiments:\n" + "\n".join(rows) + "\ntools:\n" + "\n".join(tools))


def main(argv) -> None:
  if len(argv) < 2 or argv[1].startswith("-"):
    print(_usage(), file=sys.stderr)
    sys.exit(2)
  name = argv.pop(1)
  if name in registry.by_name():
    entry.main(name)
  elif name in TOOLS:
    runpy.run_module(f"experiments.{name}", run_name="__main__", alter_sys=True)
  else:
    print(f"experiments: error: unknown experiment {name!r}\n{_usage()}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main(sys.argv)
