"""jetspec_jax: lossless speculative decoding by causal parallel tree drafting, in JAX.

The public API (DESIGN.md §4)::

  import jetspec_jax as js
  target = js.load_target(path)
  out = js.generate(target, head, prompt_ids, max_new_tokens=256, method='ar')
"""

from jetspec_jax import kv_cache, testing
from jetspec_jax.decoding import GenerateOutput, GenerationStats, generate
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models import hf_io, qwen3
from jetspec_jax.models.hf_io import CheckpointError, load_target, save_target
from jetspec_jax.models.qwen3 import Qwen3Config, Target

__version__ = '0.1.0'

__all__ = [
  'CheckpointError',
  'GenerateOutput',
  'GenerationStats',
  'KVCache',
  'Qwen3Config',
  'Target',
  'generate',
  'hf_io',
  'kv_cache',
  'load_target',
  'qwen3',
  'save_target',
  'testing',
]
