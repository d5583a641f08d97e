"""The draft head's configuration: its kind, sizes, taps and mask, the defaults for a target, and
the check that a head fits its target (docs/draft_head.md §1, §7)."""

import dataclasses

from jetspec_jax.models import decoder


def head_kind(*, markov_rank: int, refine: bool, causal: bool) -> str:
  """The kind of head these settings make (:attr:`DraftHeadConfig.kind`; also read from a
  training config before any model exists)."""
  if markov_rank:
    return 'dspark'
  if refine:
    return 'jetspecpp'
  return 'jetspec' if causal else 'dflash'


@dataclasses.dataclass(frozen=True)
class DraftHeadConfig:
  """Architecture of a draft head. Hashable: a static ``jit`` argument.

  Attributes:
    hidden_size: must equal the target's (the head uses the target's embedding and LM head).
    target_layer_ids: tapped target layers, in fusion order (docs/draft_head.md §2).
    num_target_layers: layers of the target the head was built for.
    block_size: slots per block; the maximum draft depth is ``block_size - 1``.
    mask_token_id: token id of the MASK slots (the target's frozen embedding row).
    causal: lower-triangular in-block mask (JetSpec) or full (DFlash baseline).
    markov_rank: ``> 0`` makes a DSpark head (:mod:`jetspec_jax.methods.dspark`): a bidirectional
      backbone whose anchor slot predicts too (block ``bs`` drafts ``bs`` tokens), a rank-``r``
      Markov bias over the previous drafted token, and a confidence head.
    refine: a JetSpec++ head (:mod:`jetspec_jax.methods.jetspecpp`): causal, and its draft slots may
      hold *guessed* tokens instead of MASK (embedded as ``embed(token) + draft_embed``, one
      learned vector marking a token as unverified); with every slot MASK it is a JetSpec head.
    copy_seed: ``> 0`` seeds a JetSpec, DFlash-style or JetSpec++ head's draft slots with *copy
      candidates*: the continuation of the latest longest match (up to ``copy_seed`` tokens) of
      the context's suffix (:func:`jetspec_jax.prompt_lookup.seed_guesses`), read as guessed
      tokens (``embed(token) + draft_embed``); slots the copy cannot fill stay MASK. The head
      learns when to keep the copy and when to overrule it; trained and drafted the same way. A
      JetSpec++ head takes copy candidates only in the slots its recycled guesses leave empty.
  """

  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  vocab_size: int
  target_layer_ids: tuple[int, ...]
  num_target_layers: int
  block_size: int = 16
  mask_token_id: int = 0
  causal: bool = True
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 40960
  markov_rank: int = 0
  refine: bool = False
  copy_seed: int = 0

  def __post_init__(self):
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f'{self.num_attention_heads=} must be a multiple of {self.num_key_value_heads=}'
      )
    if self.block_size < 2:
      raise ValueError(f'{self.block_size=} must be >= 2 (anchor + at least one draft slot)')
    if not self.target_layer_ids:
      raise ValueError('target_layer_ids must name at least one target layer')
    if not 0 <= self.mask_token_id < self.vocab_size:
      raise ValueError(f'{self.mask_token_id=} is outside the vocabulary [0, {self.vocab_size})')
    if self.markov_rank < 0:
      raise ValueError(f'{self.markov_rank=} must be >= 0')
    if self.markov_rank and self.causal:
      raise ValueError('a DSpark head (markov_rank > 0) has a bidirectional backbone: causal=False')
    if self.refine and (self.markov_rank or not self.causal):
      raise ValueError('a JetSpec++ head (refine=True) is causal and has no Markov stage')
    if self.copy_seed < 0:
      raise ValueError(f'{self.copy_seed=} must be >= 0')
    if self.copy_seed and self.markov_rank:
      raise ValueError('copy_seed is for heads without a Markov stage (not DSpark)')

  @property
  def num_taps(self) -> int:
    return len(self.target_layer_ids)

  @property
  def kind(self) -> str:
    """``'dspark'``, ``'jetspecpp'``, ``'jetspec'`` (causal) or ``'dflash'`` (bidirectional)."""
    return head_kind(markov_rank=self.markov_rank, refine=self.refine, causal=self.causal)

  @property
  def reads_guesses(self) -> bool:
    """Its draft slots may hold guessed tokens (a JetSpec++ head, or a copy-seeded head)."""
    return self.refine or self.copy_seed > 0

  @property
  def max_depth(self) -> int:
    """Tokens one block drafts: ``bs - 1`` (the anchor slot is discarded), ``bs`` for DSpark."""
    return self.block_size if self.markov_rank else self.block_size - 1


def default_tap_layers(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
  """The reference's default tap rule (docs/draft_head.md §1): spread taps over layers 1 .. L-3."""
  if num_taps == 1:
    return (num_target_layers // 2,)
  span = num_target_layers - 4
  return tuple(int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps))


def config_for_target(
  target_cfg: decoder.DecoderConfig,
  *,
  num_layers: int = 2,
  block_size: int = 16,
  causal: bool = True,
  target_layer_ids: tuple[int, ...] | None = None,
  mask_token_id: int | None = None,
  intermediate_size: int | None = None,
  markov_rank: int = 0,
  refine: bool = False,
  copy_seed: int = 0,
) -> DraftHeadConfig:
  """A head config that fits ``target_cfg`` (same width, heads, vocab and RoPE)."""
  if target_layer_ids is None:
    target_layer_ids = default_tap_layers(target_cfg.num_hidden_layers, min(num_layers, 5))
  return DraftHeadConfig(
    hidden_size=target_cfg.hidden_size,
    intermediate_size=intermediate_size or target_cfg.intermediate_size,
    num_hidden_layers=num_layers,
    num_attention_heads=target_cfg.num_attention_heads,
    num_key_value_heads=target_cfg.num_key_value_heads,
    head_dim=target_cfg.head_dim,
    vocab_size=target_cfg.vocab_size,
    target_layer_ids=tuple(target_layer_ids),
    num_target_layers=target_cfg.num_hidden_layers,
    block_size=block_size,
    mask_token_id=target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
    causal=causal,
    rope_theta=target_cfg.rope_theta,
    rms_norm_eps=target_cfg.rms_norm_eps,
    max_position_embeddings=target_cfg.max_position_embeddings,
    markov_rank=markov_rank,
    refine=refine,
    copy_seed=copy_seed,
  )


def check_fits_target(cfg: DraftHeadConfig, target_cfg: decoder.DecoderConfig) -> None:
  """Raises a ValueError naming the first mismatch between a head and a target."""
  if cfg.hidden_size != target_cfg.hidden_size:
    raise ValueError(
      f'head hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}'
    )
  if cfg.vocab_size != target_cfg.vocab_size:
    raise ValueError(
      f'head vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}'
    )
  if cfg.num_target_layers != target_cfg.num_hidden_layers:
    raise ValueError(
      f'head was built for a {cfg.num_target_layers}-layer target, this target has '
      f'{target_cfg.num_hidden_layers} layers'
    )
  bad = [i for i in cfg.target_layer_ids if not 0 <= i < target_cfg.num_hidden_layers]
  if bad:
    raise ValueError(
      f"head taps target layers {bad}, outside the target's [0, {target_cfg.num_hidden_layers})"
    )


# Modules.
