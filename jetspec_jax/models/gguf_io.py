"""GGUF import for Llama-family targets (Llama / SmolLM2, Qwen2, Qwen3), cached as HF safetensors.

A GGUF file (llama.cpp's format) holds the architecture as metadata and every tensor, often
block-quantized. :func:`convert` reads it with the ``gguf`` package's reader, dequantizes each
tensor here (numpy, float32), undoes llama.cpp's Q/K row permutation (Llama only), maps names to
the Hugging Face layout, and returns ``(config.json dict, tensors)``. :func:`cached_checkpoint`
writes that once under the user's cache directory, so the second load reads safetensors in
seconds. The entry is named by a SHA-256 of the whole source file, and trusted only when its
manifest (size and SHA-256 of every file in it) matches; anything else rebuilds it.

Tensor types (``GGML_TYPE``). Every type the ``gguf`` package's ``gguf.quants`` decodes is read
(the K-quants Q2_K..Q6_K of the common Q4_K_M / Q5_K_M / Q6_K files, Q5_0/Q5_1, the IQ and TQ
types, MXFP4); these, decoded here in numpy, are 6-40x faster than ``gguf.quants`` on the 135M
model's tensors (``tests/test_gguf.py`` checks that both agree)::

  F32, F16, BF16      plain
  Q8_0   34 B/block   d:f16, q:int8[32]           x = d * q
  Q4_0   18 B/block   d:f16, q:u4[32] (packed)    x = d * (q - 8)
  Q4_1   20 B/block   d:f16, m:f16, q:u4[32]      x = d * q + m

Packed 4-bit blocks store value ``j`` in the low nibble of byte ``j`` and value ``j + 16`` in its
high nibble. A type neither decodes is a :class:`CheckpointError` naming the tensor and the type.

Llama-3.1-style files carry their RoPE scaling as a ``rope_freqs`` tensor (one divisor per
frequency, which llama.cpp's converter computes from the ``llama3`` rope parameters); it is read
back into those parameters (:func:`llama3_scaling_from_freq_factors`), checked to reproduce every
factor.
"""

import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib

import numpy as np

from jetspec_jax.models import decoder
from jetspec_jax.models.checkpoint_files import CheckpointError, rope_scaling_from_hf
from jetspec_jax.models.decoder.layers import rope_inv_freq

# Bump when the conversion's output changes, so stale cache entries are not reused.
CONVERTER_VERSION = 2
SUPPORTED_ARCHITECTURES = ('llama', 'qwen2', 'qwen3')

# GGML type id -> name, for the types handled below and for error messages.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_BLOCK = 32


def _gguf():
  try:
    import gguf
  except ImportError as e:  # a declared dependency, but say what to do if it is missing
    raise ImportError('reading GGUF files needs the `gguf` package: pip install gguf') from e
  return gguf


def _gguf_version() -> str:
  try:
    return 'gguf ' + importlib.metadata.version('gguf')
  except importlib.metadata.PackageNotFoundError:
    return 'gguf, version unknown'


def type_name(ggml_type: int) -> str:
  try:
    return _gguf().GGMLQuantizationType(ggml_type).name
  except ValueError:
    return f'unknown type {ggml_type}'


# Dequantization.


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
  raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
  if raw.size % block_bytes:
    raise ValueError(f'{raw.size} bytes is not a whole number of {block_bytes}-byte blocks')
  return raw.reshape(-1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
  return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
  """``[n, 16]`` bytes -> ``[n, 32]`` values: low nibbles first, then high nibbles."""
  return np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)


def _dequantize_with_gguf(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
  gguf = _gguf()
  try:
    qtype = gguf.GGMLQuantizationType(ggml_type)
  except ValueError:
    raise NotImplementedError(type_name(ggml_type)) from None
  if qtype not in gguf.GGML_QUANT_SIZES:
    raise NotImplementedError(qtype.name)
  block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
  if shape[-1] % block:
    raise ValueError(f'a row of {shape[-1]} values is not a whole number of {block}-value blocks')
  rows = np.ascontiguousarray(raw, np.uint8).reshape(-1)
  row_bytes = shape[-1] // block * block_bytes
  if rows.size % row_bytes:
    raise ValueError(f'{rows.size} bytes is not a whole number of {row_bytes}-byte rows')
  try:
    values = gguf.quants.dequantize(rows.reshape(-1, row_bytes), qtype)
  except NotImplementedError:  # a type this gguf version cannot decode
    raise NotImplementedError(qtype.name) from None
  return values.astype(np.float32)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
  """Raw tensor bytes of a GGML type -> float32 array of ``shape`` (numpy order).

  The types listed in the module docstring are decoded here; every other type ``gguf.quants``
  knows goes through it.

  Raises:
    NotImplementedError: for a type neither decodes.
  """
  count = int(np.prod(shape))
  if ggml_type == F32:
    out = np.frombuffer(np.ascontiguousarray(raw).tobytes(), np.float32)
  elif ggml_type == F16:
    out = np.frombuffer(np.ascontiguousarray(raw).tobytes(), np.float16).astype(np.float32)
  elif ggml_type == BF16:
    bits = np.frombuffer(np.ascontiguousarray(raw).tobytes(), np.uint16).astype(np.uint32)
    out = (bits << 16).view(np.float32)
  elif ggml_type == Q8_0:
    b = _blocks(raw, 2 + _BLOCK)
    out = _f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)
  elif ggml_type == Q4_0:
    b = _blocks(raw, 2 + _BLOCK // 2)
    out = _f16(b, 0) * (_nibbles(b[:, 2:]) - 8.0)
  elif ggml_type == Q4_1:
    b = _blocks(raw, 4 + _BLOCK // 2)
    out = _f16(b, 0) * _nibbles(b[:, 4:]) + _f16(b, 2)
  else:
    out = _dequantize_with_gguf(raw, ggml_type, shape)
  out = out.reshape(-1)
  if out.size != count:
    raise ValueError(f'{out.size} values decoded, the shape {shape} holds {count}')
  return out.reshape(shape)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's conversion-time Q/K row permutation (rows ``[heads*H, ...]``).

  llama.cpp stores each head's rows interleaved (pairs ``(i, i + H/2)`` adjacent) for its own
  RoPE kernel; Hugging Face uses the half-split layout.
  """
  half = w.shape[0] // num_heads // 2
  return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
  """The permutation llama.cpp applies when converting (inverse of :func:`unpermute_qk`)."""
  half = w.shape[0] // num_heads // 2
  return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Reading a file.


def _open(path: pathlib.Path):
  if not path.exists():
    raise FileNotFoundError(f'GGUF file {path} does not exist')
  try:
    return _gguf().GGUFReader(str(path))
  except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
    raise CheckpointError(f'cannot read {path} as GGUF (truncated or corrupt?): {e}') from e


def _field(reader, key: str, default=None):
  field = reader.fields.get(key)
  if field is None:
    return default
  return field.contents()


def read_metadata(path: str | os.PathLike, keys=None) -> dict:
  """GGUF metadata as a dict (``keys`` limits which are decoded; long arrays are slow)."""
  reader = _open(pathlib.Path(path))
  names = reader.fields if keys is None else [k for k in keys if k in reader.fields]
  return {k: _field(reader, k) for k in names}


def config_from_gguf(reader) -> dict:
  """The Hugging Face ``config.json`` dict of the model a GGUF file holds."""
  arch = _field(reader, 'general.architecture')
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(
      f'unsupported GGUF architecture {arch!r}; supported: {list(SUPPORTED_ARCHITECTURES)}'
    )

  def meta(key, default=None, required=False):
    value = _field(reader, f'{arch}.{key}', default)
    if required and value is None:
      raise CheckpointError(f'GGUF metadata lacks {arch}.{key}')
    return value

  scaling = meta('rope.scaling.type')
  if scaling not in (None, 'none'):
    raise CheckpointError(f'GGUF rope scaling {scaling!r} is not supported')
  names = {t.name for t in reader.tensors}
  heads = int(meta('attention.head_count', required=True))
  hidden = int(meta('embedding_length', required=True))
  vocab = meta('vocab_size')
  if vocab is None:
    tokens = reader.fields.get('tokenizer.ggml.tokens')
    if tokens is None:
      raise CheckpointError(f'GGUF metadata gives neither {arch}.vocab_size nor a token list')
    vocab = len(tokens.data)
  hf = dict(
    architectures=[decoder.HF_ARCHITECTURES[arch]],  # GGUF's architecture names are model types
    model_type=arch,
    vocab_size=int(vocab),
    hidden_size=hidden,
    intermediate_size=int(meta('feed_forward_length', required=True)),
    num_hidden_layers=int(meta('block_count', required=True)),
    num_attention_heads=heads,
    num_key_value_heads=int(meta('attention.head_count_kv', heads)),
    head_dim=int(meta('attention.key_length', hidden // heads)),
    rope_theta=float(meta('rope.freq_base', 10_000.0)),
    rms_norm_eps=float(meta('attention.layer_norm_rms_epsilon', 1e-6)),
    max_position_embeddings=int(meta('context_length', 4096)),
    tie_word_embeddings='output.weight' not in names,
    hidden_act='silu',
  )
  if ROPE_FREQS in names:
    if arch != 'llama':
      raise CheckpointError(f'GGUF rope_freqs in a {arch!r} model is not supported (llama only)')
    (tensor,) = [t for t in reader.tensors if t.name == ROPE_FREQS]
    factors = dequantize(
      np.asarray(tensor.data), int(tensor.tensor_type), (int(tensor.n_elements),)
    )
    original = meta('rope.scaling.original_context_length') or hf['max_position_embeddings']
    scaling = llama3_scaling_from_freq_factors(
      factors, head_dim=hf['head_dim'], theta=hf['rope_theta'], original=int(original)
    )
    hf['rope_scaling'] = dict(rope_type='llama3', **dataclasses.asdict(scaling))
  eos = _field(reader, 'tokenizer.ggml.eos_token_id')
  bos = _field(reader, 'tokenizer.ggml.bos_token_id')
  if eos is not None:
    hf['eos_token_id'] = int(eos)
  if bos is not None:
    hf['bos_token_id'] = int(bos)
  return hf


_LAYER_NAMES = {
  'attn_norm.weight': 'input_layernorm.weight',
  'ffn_norm.weight': 'post_attention_layernorm.weight',
  'attn_q.weight': 'self_attn.q_proj.weight',
  'attn_k.weight': 'self_attn.k_proj.weight',
  'attn_v.weight': 'self_attn.v_proj.weight',
  'attn_q.bias': 'self_attn.q_proj.bias',
  'attn_k.bias': 'self_attn.k_proj.bias',
  'attn_v.bias': 'self_attn.v_proj.bias',
  'attn_output.weight': 'self_attn.o_proj.weight',
  'attn_q_norm.weight': 'self_attn.q_norm.weight',
  'attn_k_norm.weight': 'self_attn.k_norm.weight',
  'ffn_gate.weight': 'mlp.gate_proj.weight',
  'ffn_up.weight': 'mlp.up_proj.weight',
  'ffn_down.weight': 'mlp.down_proj.weight',
}
_GLOBAL_NAMES = {
  'token_embd.weight': 'model.embed_tokens.weight',
  'output_norm.weight': 'model.norm.weight',
  'output.weight': 'lm_head.weight',
}


ROPE_FREQS = 'rope_freqs.weight'


def llama3_scaling_from_freq_factors(
  factors: np.ndarray, *, head_dim: int, theta: float, original: int
) -> decoder.RopeScaling:
  """The ``llama3`` rope parameters that give llama.cpp's per-frequency divisors ``factors``.

  llama.cpp divides inverse frequency ``i`` by ``factors[i]``: 1 for wavelengths below
  ``original / high_freq_factor``, ``factor`` above ``original / low_freq_factor``, and
  ``1 / ((1 - s) / factor + s)`` between, with ``s = (original / wavelength - low) / (high - low)``
  linear in the inverse wavelength. Only the ratios ``original / low`` and ``original / high``
  matter, so ``original`` is taken from the metadata (or the context length) and the two factors
  are solved from the band. The result is checked to reproduce every factor.

  Raises:
    CheckpointError: for factors no ``llama3`` scaling produces.
  """
  factors = np.asarray(factors, np.float64).reshape(-1)
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if factors.shape != inv_freq.shape or not np.all(np.isfinite(factors) & (factors >= 1.0 - 1e-6)):
    raise CheckpointError(
      f'GGUF rope_freqs has {factors.size} values, want {inv_freq.size} finite divisors >= 1'
    )
  factor = float(factors.max())
  x = 1.0 / (2 * np.pi / inv_freq)  # inverse wavelength
  tol = 1e-5 * factor
  keep = factors <= 1.0 + tol
  scale = factors >= factor - tol
  band = ~keep & ~scale
  error = CheckpointError(
    'GGUF rope_freqs are not a Llama-3 (llama3) frequency scaling; no other kind is supported'
  )
  if factor <= 1.0 + tol or not keep.any():
    raise error
  # On the band s = a * x + b, with a = original / (high - low) and b = -low / (high - low).
  if band.sum() >= 2:
    s = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    a, b = np.polyfit(x[band], s, 1)
    span = original / a
    low = -b * span
    high = low + span
  else:  # no band to fit: put both edges in the gap between kept and scaled frequencies
    gap = np.sqrt(x[keep].min() * x[~keep].max())
    high = original * gap * (1 + 1e-3)
    low = original * gap * (1 - 1e-3) if band.sum() == 0 else original * x[band].min() * (1 - 1e-3)
  if not (np.isfinite(low) and np.isfinite(high) and 0 < low < high):
    raise error
  scaling = decoder.RopeScaling(factor, float(low), float(high), int(original))
  want = (inv_freq / factors).astype(np.float32)
  got = rope_inv_freq(head_dim, theta, scaling)
  if not np.allclose(got, want, rtol=1e-4, atol=0):
    raise error
  return scaling


def llama_cpp_freq_factors(
  head_dim: int,
  theta: float,
  *,
  factor: float,
  low_freq_factor: float,
  high_freq_factor: float,
  original: int,
) -> np.ndarray:
  """The ``rope_freqs`` divisors llama.cpp's converter writes for ``llama3`` rope parameters."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelength = 2 * np.pi / inv_freq
  smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
  band = 1.0 / ((1 - smooth) / factor + smooth)
  out = np.where(wavelength < original / high_freq_factor, 1.0, band)
  return np.where(wavelength > original / low_freq_factor, factor, out).astype(np.float32)


def hf_name(gguf_name: str) -> str:
  """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  parts = gguf_name.split('.', 2)
  if len(parts) == 3 and parts[0] == 'blk' and parts[2] in _LAYER_NAMES:
    return f'model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}'
  raise CheckpointError(f'GGUF tensor {gguf_name!r} has no Hugging Face counterpart')


def convert(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """Reads a GGUF file: ``(HF config.json dict, HF-named float32 tensors)``."""
  path = pathlib.Path(path)
  reader = _open(path)
  hf = config_from_gguf(reader)
  tensors = {}
  for t in reader.tensors:
    if t.name == ROPE_FREQS:  # read into the config's rope_scaling
      continue
    name = hf_name(t.name)
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
    try:
      raw = np.asarray(reader.data[t.data_offset : t.data_offset + t.n_bytes])
      if raw.size != t.n_bytes:
        raise ValueError(f'{raw.size} of {t.n_bytes} bytes present (truncated file?)')
      value = dequantize(raw, int(t.tensor_type), shape)
    except NotImplementedError as e:
      raise CheckpointError(
        f'GGUF tensor {t.name} has type {e.args[0]}, which neither this module nor the '
        f'installed gguf package ({_gguf_version()}) decodes'
      ) from e
    except ValueError as e:
      raise CheckpointError(f'cannot decode GGUF tensor {t.name} in {path}: {e}') from e
    if hf['model_type'] == 'llama' and name.endswith(('q_proj.weight', 'k_proj.weight')):
      heads = hf['num_attention_heads'] if 'q_proj' in name else hf['num_key_value_heads']
      value = unpermute_qk(value, heads)
    tensors[name] = value
  return hf, tensors


# Writing (tests and users who want a quantized copy).


def write_gguf(
  path: str | os.PathLike,
  hf_config: dict,
  tensors: dict[str, np.ndarray],
  *,
  tensor_types: dict[str, int] | None = None,
  default_type: int = F32,
  tokenizer_metadata: dict | None = None,
) -> None:
  """Writes HF-named tensors of a Llama-family model as a GGUF file (llama.cpp's layout).

  Args:
    path: output file.
    hf_config: the model's ``config.json`` dict.
    tensors: HF-named float arrays; a ``uint8`` array ``[rows, row bytes]`` is taken as blocks
      already encoded in its ``tensor_types`` type (``gguf.quants`` cannot quantize the
      K-quants, so tests encode those themselves).
    tensor_types: GGML type per HF name (others: ``default_type``; 1-D tensors stay F32).
    tokenizer_metadata: extra ``tokenizer.*`` keys (strings, ints, lists).
  """
  gguf = _gguf()
  arch = hf_config['model_type']
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f'cannot write architecture {arch!r} as GGUF')
  reverse = {v: k for k, v in _GLOBAL_NAMES.items()}
  layer_reverse = {v: k for k, v in _LAYER_NAMES.items()}
  writer = gguf.GGUFWriter(str(path), arch)
  heads = hf_config['num_attention_heads']
  kv_heads = hf_config.get('num_key_value_heads') or heads
  writer.add_block_count(hf_config['num_hidden_layers'])
  writer.add_context_length(hf_config.get('max_position_embeddings', 4096))
  writer.add_embedding_length(hf_config['hidden_size'])
  writer.add_feed_forward_length(hf_config['intermediate_size'])
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_rope_freq_base(float(hf_config.get('rope_theta', 10_000.0)))
  writer.add_layer_norm_rms_eps(float(hf_config.get('rms_norm_eps', 1e-6)))
  writer.add_vocab_size(hf_config['vocab_size'])
  head_dim = hf_config.get('head_dim') or hf_config['hidden_size'] // heads
  writer.add_key_length(head_dim)
  writer.add_value_length(head_dim)
  writer.add_rope_dimension_count(head_dim)
  writer.add_file_type(1)
  scaling = rope_scaling_from_hf(hf_config)  # the config reader's own rope rules
  if scaling is not None:
    if arch != 'llama':
      raise ValueError(f'llama3 rope scaling in a {arch!r} model cannot be written as GGUF')
    original = scaling.original_max_position_embeddings
    writer.add_uint32(f'{arch}.rope.scaling.original_context_length', original)
    factors = llama_cpp_freq_factors(
      head_dim,
      float(hf_config.get('rope_theta', 10_000.0)),
      factor=scaling.factor,
      low_freq_factor=scaling.low_freq_factor,
      high_freq_factor=scaling.high_freq_factor,
      original=original,
    )
    writer.add_tensor(ROPE_FREQS, factors)
  for key, value in (tokenizer_metadata or {}).items():
    if isinstance(value, str):
      writer.add_string(key, value)
    elif isinstance(value, bool):
      writer.add_bool(key, value)
    elif isinstance(value, int):
      writer.add_uint32(key, value)
    else:
      writer.add_array(key, list(value))
  for name, value in tensors.items():
    if name == 'lm_head.weight' and hf_config.get('tie_word_embeddings'):
      continue
    if name in reverse:
      gguf_name = reverse[name]
    else:
      _, _, layer, rest = name.split('.', 3)
      gguf_name = f'blk.{layer}.{layer_reverse[rest]}'
    value = np.asarray(value)
    encoded = value.dtype == np.uint8  # blocks already in their GGML type (rows x bytes)
    if not encoded:
      value = value.astype(np.float32)
    if arch == 'llama' and name.endswith(('q_proj.weight', 'k_proj.weight')):
      value = permute_qk(value, heads if 'q_proj' in name else kv_heads)  # rows: either form
    qtype = (tensor_types or {}).get(name, default_type) if value.ndim > 1 else F32
    qtype = gguf.GGMLQuantizationType(qtype)
    if encoded:
      writer.add_tensor(gguf_name, value, raw_shape=value.shape, raw_dtype=qtype)
    elif qtype == gguf.GGMLQuantizationType.F32:
      writer.add_tensor(gguf_name, value)
    elif qtype == gguf.GGMLQuantizationType.F16:
      writer.add_tensor(gguf_name, value.astype(np.float16))
    else:
      data = gguf.quants.quantize(value, qtype)
      writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
