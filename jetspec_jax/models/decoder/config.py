"""The decoder family's config and the named presets: Qwen3, Qwen3-MoE, Qwen2 and the Llama family
(SmolLM2) behind one :class:`DecoderConfig`, whose ``model_type`` names the family for
checkpoint I/O."""

import dataclasses

# Each family's Hugging Face ``architectures`` name (the ``model_type`` is the key).
HF_ARCHITECTURES = {
  'qwen3': 'Qwen3ForCausalLM',
  'qwen3_moe': 'Qwen3MoeForCausalLM',
  'llama': 'LlamaForCausalLM',
  'qwen2': 'Qwen2ForCausalLM',
}
MODEL_TYPES = tuple(HF_ARCHITECTURES)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 RoPE frequency scaling (``rope_type: llama3`` in Hugging Face configs).

  Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
  ``factor``, shorter than ``original / high_freq_factor`` kept, and the band between is
  interpolated smoothly (Hugging Face's ``_compute_llama3_parameters``).
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    if self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(f'{self.high_freq_factor=} must exceed {self.low_freq_factor=}')


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Architecture of a target transformer. Hashable: a static ``jit`` argument.

  ``num_experts == 0`` means dense. For MoE, layer ``i`` is sparse iff ``i`` is not in
  ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (Hugging Face's rule).
  The Llama family is the same module with ``qk_norm=False`` (and ``attention_bias=True`` for
  Qwen2's q/k/v biases); ``model_type`` only decides how the config is written back to disk.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 40960
  # Qwen3-MoE.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  eos_token_id: int | None = None
  # Family switches (Qwen3 defaults).
  model_type: str = 'qwen3'
  qk_norm: bool = True
  attention_bias: bool = False
  rope_scaling: RopeScaling | None = None

  def __post_init__(self):
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f'model_type must be one of {MODEL_TYPES}, got {self.model_type!r}')
    if (self.num_experts > 0) != (self.model_type == 'qwen3_moe'):
      raise ValueError(
        f"{self.num_experts=} needs model_type 'qwen3_moe' (and only it has experts)"
      )
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f'{self.num_attention_heads=} must be a multiple of {self.num_key_value_heads=}'
      )
    if self.head_dim % 2:
      raise ValueError(f'{self.head_dim=} must be even for rotary embeddings')
    if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError(f'{self.num_experts_per_tok=} must be in [1, {self.num_experts=}]')

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def heads_per_kv(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  def is_sparse_layer(self, i: int) -> bool:
    return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


def qwen3_0_6b() -> DecoderConfig:
  return DecoderConfig(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    eos_token_id=151645,
  )


def qwen3_8b() -> DecoderConfig:
  return DecoderConfig(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
    eos_token_id=151645,
  )


def qwen3_30b_a3b() -> DecoderConfig:
  return DecoderConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    tie_word_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    eos_token_id=151645,
    model_type='qwen3_moe',
  )


def smollm2_135m() -> DecoderConfig:
  """SmolLM2-135M(-Instruct): Llama architecture, 30 layers, 9 query / 3 KV heads, tied."""
  return DecoderConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    eos_token_id=2,
    model_type='llama',
    qk_norm=False,
  )


def tiny(**overrides) -> DecoderConfig:
  """A small dense config with odd, prime-ish sizes so shape bugs show."""
  base = dict(
    vocab_size=257,
    hidden_size=44,
    intermediate_size=67,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=14,
    rope_theta=10_000.0,
    max_position_embeddings=512,
  )
  return DecoderConfig(**{**base, **overrides})


def tiny_moe(**overrides) -> DecoderConfig:
  """A small Qwen3-MoE config: 5 experts, top-2, one dense layer."""
  base = dict(
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=23,
    mlp_only_layers=(1,),
    model_type='qwen3_moe',
  )
  return tiny(**{**base, **overrides})


def tiny_llama(**overrides) -> DecoderConfig:
  """A small Llama-family config (no q/k norm, tied embeddings, Llama-3 RoPE scaling)."""
  base = dict(
    model_type='llama',
    qk_norm=False,
    tie_word_embeddings=True,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
  )
  return tiny(**{**base, **overrides})


# Every named config (real shapes and tiny test models), for binaries and configs to name.
PRESETS = {
  'qwen3_0_6b': qwen3_0_6b,
  'qwen3_8b': qwen3_8b,
  'qwen3_30b_a3b': qwen3_30b_a3b,
  'smollm2_135m': smollm2_135m,
  'tiny': tiny,
  'tiny_moe': tiny_moe,
  'tiny_llama': tiny_llama,
}
