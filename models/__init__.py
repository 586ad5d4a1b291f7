"""Flax (Linen) Llama-family port: loading (HF safetensors, GGUF), tokenizer, decode loop.

  model = models.load("smollm2-135m-instruct")          # or an HF directory
  out = models.generate(model, model.encode("Hi", chat=True), 32, methods.make("quest"))
  out = models.generate(model, ids, 32, method, mesh=models.make_mesh(data=2, model=2, seq=2))
  models.available()   # the loadable names, their source, size and install state
"""

from models import sampling
from models.config import ModelConfig, RopeConfig
from models.decode import Generation, generate, teacher_forced
from models.loading import Model, load
from models.sampling import Sampling
from models.sharding import make_mesh, shard
from models.sources import ModelEntry, available

__all__ = ["ModelConfig", "RopeConfig", "Model", "load", "generate", "teacher_forced",
           "Generation", "Sampling", "available", "ModelEntry", "make_mesh", "shard"]
