"""jetspec_jax: lossless speculative decoding by causal parallel tree drafting, in JAX.

The public API (DESIGN.md §4)::

  import jetspec_jax as js
  target = js.load_target(path)
  head = js.load_draft_head(head_path, target)
  out = js.generate(target, head, prompt_ids, max_new_tokens=256, method='tree')
"""

from jetspec_jax import (
  chat_prompts,
  decoding,
  dspark,
  jetspecpp,
  kv_cache,
  rounds,
  sharding,
  testing,
  tree,
  verify,
  viz,
)
from jetspec_jax.decoding import GenerateOutput, GenerationStats, generate
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models import draft_head, gguf_io, hf_io, qwen3
from jetspec_jax.models.draft_head import DraftHead, DraftHeadConfig
from jetspec_jax.models.hf_io import (
  CheckpointError,
  load_draft_head,
  load_target,
  save_draft_head,
  save_target,
)
from jetspec_jax.models.qwen3 import Qwen3Config, Target
from jetspec_jax.tokenizer import Tokenizer, load_tokenizer
from jetspec_jax.tree import Tree

__version__ = '0.1.0'

__all__ = [
  'CheckpointError',
  'DraftHead',
  'DraftHeadConfig',
  'GenerateOutput',
  'GenerationStats',
  'KVCache',
  'Qwen3Config',
  'Target',
  'Tokenizer',
  'Tree',
  'chat_prompts',
  'decoding',
  'draft_head',
  'dspark',
  'generate',
  'gguf_io',
  'hf_io',
  'jetspecpp',
  'kv_cache',
  'load_draft_head',
  'load_target',
  'load_tokenizer',
  'qwen3',
  'rounds',
  'save_draft_head',
  'save_target',
  'sharding',
  'testing',
  'tree',
  'verify',
  'viz',
]
