"""Which methods decode context-parallel: a ``Method`` subclass with its own selection never
(it would be scored as Quest there); the 8-device equality is in tests/models/sharded_cases.py."""

import dataclasses

from sparse_attn import context_parallel, methods, selection


@dataclasses.dataclass(frozen=True)
class _Centroid(methods.Method):
  """notebooks/custom_selector.ipynb's way: a subclass overriding ``select``."""

  def select(self, q, cache, scale=None):
    b, hq, d = q.shape
    pooled = q.reshape(b, cache.num_kv_heads, hq // cache.num_kv_heads, d).mean(axis=2)
    return selection.select_blocks((pooled[:, :, None] * cache.kcen).sum(-1), cache,
                                   self.budget)


def test_subclass_with_its_own_select_is_not_context_parallel():
  quest = methods.make("quest", budget=0.1)
  custom = _Centroid(**{**vars(quest), "digests": ("box", "sphere")})
  assert context_parallel.supports(quest)
  assert context_parallel.own_pipeline(custom) == ("select",)
  assert not context_parallel.supports(custom)
