"""jetspec_jax: lossless speculative decoding by causal parallel tree drafting, in JAX.

The public API (docs/design.md §4)::

  import jetspec_jax as js
  target = js.load_target(path)
  head = js.load_draft_head(head_path, target)
  out = js.generate(target, head, prompt_ids, max_new_tokens=256, method=js.methods.Tree(budget=16))
"""

from jetspec_jax import (
  decoding,
  kv_cache,
  methods,
  online,
  rounds,
  sharding,
  testing,
  tree,
  verify,
  viz,
)
from jetspec_jax.decoding import GenerateOutput, GenerationStats, generate
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models import decoder, draft_head, gguf_io, head_io, hf_io, model_cache
from jetspec_jax.models.decoder import DecoderConfig, Target
from jetspec_jax.models.draft_head import DraftHead, DraftHeadConfig
from jetspec_jax.models.head_io import load_draft_head, save_draft_head
from jetspec_jax.models.hf_io import CheckpointError, load_target, save_target
from jetspec_jax.tokenizer import Tokenizer, load_tokenizer
from jetspec_jax.tree import Tree

__version__ = '0.1.0'

__all__ = [
  'CheckpointError',
  'DecoderConfig',
  'DraftHead',
  'DraftHeadConfig',
  'GenerateOutput',
  'GenerationStats',
  'KVCache',
  'Target',
  'Tokenizer',
  'Tree',
  'decoder',
  'decoding',
  'draft_head',
  'generate',
  'gguf_io',
  'head_io',
  'hf_io',
  'kv_cache',
  'load_draft_head',
  'load_target',
  'model_cache',
  'load_tokenizer',
  'methods',
  'online',
  'rounds',
  'save_draft_head',
  'save_target',
  'sharding',
  'testing',
  'tree',
  'verify',
  'viz',
]
