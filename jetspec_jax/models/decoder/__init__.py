"""The target transformer in Flax Linen, used functionally: Qwen3, Qwen3-MoE and the Llama family.

One model with config switches covers the families (docs/design.md §2): Qwen3 (per-head q/k RMSNorm,
no bias), Qwen3-MoE (sparse MLP blocks), Llama / SmolLM2 (no q/k norm, optional Llama-3 RoPE
scaling) and Qwen2 (q/k/v bias). ``DecoderConfig.model_type`` names the family for checkpoint I/O.

One forward serves three modes (docs/design.md §5):

* **prefill** (causal): ``T`` prompt tokens written to slots ``0..T-1``;
* **decode**: one token written at its slot, attending to every earlier slot;
* **masked**: new tokens at explicit positions and slots, with an explicit boolean mask over the
  cache slots (committed prefix + the new tokens themselves). The tree verifier uses it.

The new tokens' K/V are first written into the cache at ``slots``; attention then reads only the
used part of the cache: an online softmax over the key tiles that hold a slot some query may see
(:func:`attention_live`), so memory stays linear in ``T``. Without an explicit mask, query ``t``
sees every slot ``<= slots[t]`` (causal; correct because committed slots are contiguous
positions).

The forward optionally returns the residual stream after each layer in ``taps`` (the "target
features" the draft head reads, docs/draft_head.md §2), concatenated on the feature axis. A tap is
the raw residual (pre final norm) for every layer; note that Hugging Face's last ``hidden_states``
entry is post final norm, so it differs for ``L = num_layers - 1`` only.

Layout: :mod:`~jetspec_jax.models.decoder.config` (the config and presets),
:mod:`~jetspec_jax.models.decoder.layers` (norm, RoPE, attention, MLP / MoE, the layer) and
:mod:`~jetspec_jax.models.decoder.model` (the model, the functional API and :class:`Target`).
"""

from jetspec_jax.models.decoder.config import (
  HF_ARCHITECTURES,
  MODEL_TYPES,
  PRESETS,
  DecoderConfig,
  RopeScaling,
  qwen3_0_6b,
  qwen3_8b,
  qwen3_30b_a3b,
  smollm2_135m,
  tiny,
  tiny_llama,
  tiny_moe,
)
from jetspec_jax.models.decoder.layers import (
  ATTN_IMPLS,
  MASK_VALUE,
  MLP,
  Attention,
  CausalSlots,
  DecoderLayer,
  DenseMask,
  Experts,
  RMSNorm,
  SparseMoE,
  TailMask,
  attention_live,
  attention_xla,
  online_softmax_step,
  rope,
  rope_inv_freq,
)
from jetspec_jax.models.decoder.model import (
  Decoder,
  ForwardOutput,
  Target,
  check_token_ids,
  count_params,
  embed,
  forward,
  init_params,
  lm_logits,
  make_cache,
  validate_forward_args,
)

__all__ = [
  'ATTN_IMPLS',
  'Attention',
  'CausalSlots',
  'Decoder',
  'DecoderConfig',
  'DecoderLayer',
  'DenseMask',
  'Experts',
  'ForwardOutput',
  'HF_ARCHITECTURES',
  'MASK_VALUE',
  'MLP',
  'MODEL_TYPES',
  'PRESETS',
  'RMSNorm',
  'RopeScaling',
  'SparseMoE',
  'TailMask',
  'Target',
  'attention_live',
  'attention_xla',
  'check_token_ids',
  'count_params',
  'embed',
  'forward',
  'init_params',
  'lm_logits',
  'make_cache',
  'online_softmax_step',
  'qwen3_0_6b',
  'qwen3_30b_a3b',
  'qwen3_8b',
  'rope',
  'rope_inv_freq',
  'smollm2_135m',
  'tiny',
  'tiny_llama',
  'tiny_moe',
  'validate_forward_args',
]
