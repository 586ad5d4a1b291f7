"""PTX-level checks of the kernels without a GPU: Triton IR out of jax, PTX out of PyPI Triton.

    python -m pallas_kernels.ptx            # every kernel at Llama-3.1-8B decode shapes

``triton_modules`` exports a jitted function for CUDA (``jax.export``, the same lowering a GPU
run uses) and reads each Pallas call's Triton IR back from the custom call's backend config
(MLIR bytecode, parsed with jaxlib's Triton dialect). ``compile_sm90`` compiles that IR with the
``triton`` package (the ``ptx`` extra) for ``cuda:90`` with the call's own ``num_warps`` /
``num_stages``; ``pipeline_report`` reads what an H100 would run: shared memory per program and
the software pipeline of the main loop (the depth of the ``cp.async`` ring and how many copy
groups stay in flight at the loop's wait).

Letters (besides the table of ``sparse_attn``): ST stages of the cp.async ring.
"""

from __future__ import annotations

import dataclasses
import re

import jax

TRITON_CALL = "__gpu$xla.gpu.triton"
# H100 (sm_90): 228 KB of shared memory per SM, at most 227 KB for one thread block.
H100_SMEM_PER_BLOCK = 227 * 1024
H100_SMEM_PER_SM = 228 * 1024


@dataclasses.dataclass(frozen=True)
class TritonModule:
  """One Pallas call of an exported function: its Triton IR and launch parameters."""
  name: str
  ttir: str
  num_warps: int
  num_stages: int
  grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class PipelineReport:
  """What the sm_90 compilation of one kernel does with memory.

  Attributes:
    name: kernel name.
    shared_bytes: shared memory per program (Triton's allocation).
    ring_depth: buffers of the deepest ``cp.async`` ring in the main loop (1 = no prefetch).
    in_flight: pipeline stages the main loop's wait leaves outstanding (its ``async_wait``
      count over the copy groups one stage commits): tiles still loading while one is used.
    async_copies: ``cp.async`` instructions in the PTX.
    tma: TMA bulk copies (``cp.async.bulk.tensor``) in the PTX.
    registers, spill_bytes: ``register_usage`` (``report`` fills them; 0 from
      ``pipeline_report`` alone).
  """
  name: str
  shared_bytes: int
  ring_depth: int
  in_flight: int
  async_copies: int
  tma: int
  registers: int = 0
  spill_bytes: int = 0

  @property
  def stages_in_flight(self) -> int:
    """Stages of loads outstanding while one is consumed (``in_flight`` + the consumed one)."""
    return self.in_flight + 1 if self.ring_depth else 0

  def __str__(self):
    return (f"{self.name}: smem {self.shared_bytes / 1024:.1f} KB, cp.async ring depth "
            f"{self.ring_depth}, stages in flight {self.stages_in_flight}, "
            f"{self.async_copies} cp.async, {self.tma} TMA, {self.registers} registers, "
            f"{self.spill_bytes} bytes spilled")


def _unescape_mlir_string(text: str) -> bytes:
  """The bytes of an MLIR string attribute body (``\\XX`` hex escapes, ``\\\\``)."""
  raw = text.encode("latin-1")
  out, i = bytearray(), 0
  while i < len(raw):
    c = raw[i]
    if c == 0x5C:  # backslash
      nxt = raw[i + 1:i + 3]
      if nxt[:1] == b"\\" or nxt[:1] == b'"':
        out.append(nxt[0])
        i += 2
        continue
      out.append(int(nxt, 16))
      i += 3
      continue
    out.append(c)
    i += 1
  return bytes(out)


def _triton_ir_text(bytecode: bytes) -> str:
  # pylint: disable=g-import-not-at-top (jax internals, needed only here)
  from jax._src.lib.mlir import ir
  from jax._src.pallas.triton import lowering
  with lowering._new_ir_context():  # pylint: disable=protected-access
    return ir.Module.parse(bytecode).operation.get_asm()


def triton_modules(fn, *avals) -> list[TritonModule]:
  """Every Pallas (Triton) call of ``jax.jit(fn)`` lowered for CUDA, in program order."""
  exported = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*avals)
  text = exported.mlir_module()
  mods = []
  for call in re.finditer(r"custom_call @__gpu\$xla\.gpu\.triton\(", text):
    # The dict's fields print in key order: grid_*, ir (a string that may hold braces), name, num_*.
    rest = text[call.end():]
    ir_at = re.search(r'ir = "((?:[^"\\]|\\.)*)"', rest)
    head, tail = rest[:ir_at.start()], rest[ir_at.end():]
    num = lambda key, src: int(re.search(key + r" = (-?\d+)", src).group(1))
    mods.append(TritonModule(
        name=re.search(r'name = "([^"]*)"', tail).group(1),
        ttir=_triton_ir_text(_unescape_mlir_string(ir_at.group(1))),
        num_warps=num("num_warps", tail), num_stages=num("num_stages", tail),
        grid=(num("grid_x", head), num("grid_y", head), num("grid_z", head))))
  return mods


def compile_sm90(module: TritonModule, workdir: str):
  """Compiles ``module``'s Triton IR for ``cuda:90``; returns the ``triton`` compiled kernel."""
  import os  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  from triton.compiler import compile as triton_compile  # pylint: disable=g-import-not-at-top
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  path = os.path.join(workdir, f"{module.name}.ttir")
  with open(path, "w") as f:
    f.write(module.ttir)
  return triton_compile(path, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=module.num_warps, num_stages=module.num_stages))


def _main_loop(ttgir: str) -> tuple[int, int]:
  """``(wait_num, groups_per_stage)`` of the first loop whose body waits on async copies.

  ``wait_num``: copy groups the loop's ``ttg.async_wait`` leaves outstanding; groups per stage:
  ``ttg.async_commit_group`` ops in the loop body (one per pipelined load).
  """
  lines = ttgir.splitlines()
  indent = lambda line: len(line) - len(line.lstrip())
  for i, line in enumerate(lines):
    wait = re.search(r"ttg\.async_wait .*\{num = (\d+)", line)
    if not wait:
      continue
    for j in range(i, -1, -1):
      if "scf.for" in lines[j]:
        break
    else:
      continue
    body = []
    for line2 in lines[j + 1:]:
      if "scf.yield" in line2 and indent(line2) == indent(lines[j]) + 2:
        break
      body.append(line2)
    return int(wait.group(1)), sum("ttg.async_commit_group" in b for b in body)
  return 0, 0


def pipeline_report(name: str, shared_bytes: int, ttgir: str, ptx: str) -> PipelineReport:
  """Reads the cp.async ring and the loop wait out of the TTGIR and PTX of one kernel."""
  # Mutable shared buffers allocated with a leading ring dimension: !ttg.memdesc<Sx...>.
  rings = [int(m) for m in re.findall(
      r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x[^>]*mutable>", ttgir)]
  wait_num, groups = _main_loop(ttgir)
  return PipelineReport(
      name=name, shared_bytes=int(shared_bytes), ring_depth=max(rings, default=0),
      in_flight=wait_num // groups if groups else 0,
      async_copies=len(re.findall(r"cp\.async\.c[ag]\.", ptx)),
      tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)))


def register_usage(kernel, workdir: str) -> dict:
  """``{"registers", "spill_bytes"}`` of a compiled kernel, from ``ptxas -v`` on its PTX (the
  ``ptxas`` bundled with ``triton`` that accepts the PTX version; spills are where a kernel that
  holds its data in registers falls off its design)."""
  import glob  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import triton  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, "kernel.ptx")
  with open(path, "w") as f:
    f.write(kernel.asm["ptx"])
  arch = "sm_90a" if "sm_90a" in kernel.asm["ptx"] else "sm_90"
  errors = []
  for ptxas in sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends",
                                             "nvidia", "bin", "ptxas*"))):
    run = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", path + ".cubin"],
                         capture_output=True, text=True, check=False)
    text = run.stdout + run.stderr
    if run.returncode == 0:
      regs = re.search(r"Used (\d+) registers", text)
      spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", text)
      return dict(registers=int(regs.group(1)), spill_bytes=sum(map(int, spills)))
    errors.append(text.strip().splitlines()[0] if text.strip() else f"{ptxas}: rc {run.returncode}")
  raise RuntimeError(f"no bundled ptxas assembled the PTX: {errors}")


def report(fn, *avals, workdir: str) -> list[PipelineReport]:
  """``pipeline_report`` of every Pallas call in ``fn`` with its ``register_usage`` (needs the
  ``triton`` package)."""
  out = []
  for mod in triton_modules(fn, *avals):
    kernel = compile_sm90(mod, workdir)
    rep = pipeline_report(mod.name, kernel.metadata.shared, kernel.asm["ttgir"],
                          kernel.asm["ptx"])
    out.append(dataclasses.replace(rep, **register_usage(kernel, workdir)))
  return out


def main():
  import functools  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  from pallas_kernels import shapes  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    for kernel, per_head in shapes.KERNELS:
      fn, avals, bs = shapes.kernel_avals(kernel, "llama31_8b", per_head)
      for rep in report(functools.partial(fn, block_size=bs, impl="pallas"), *avals,
                        workdir=tmp):
        print(f"{kernel}{' (per-head)' if per_head else ''}: {rep}")


if __name__ == "__main__":
  main()
