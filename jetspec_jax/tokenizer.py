"""The byte-level BPE tokenizer of the embedded default (a ``tokenizer.json``)."""

import os
import pathlib

import numpy as np

EOS = '<|endoftext|>'
MASK = '<|mask|>'


class Tokenizer:
  """A thin wrapper over ``tokenizers.Tokenizer`` with the ids the project needs."""

  def __init__(self, path: str | os.PathLike):
    from tokenizers import Tokenizer as _Tokenizer

    path = pathlib.Path(path)
    if path.is_dir():
      path = path / 'tokenizer.json'
    if not path.exists():
      raise FileNotFoundError(f'no tokenizer at {path}')
    self._tok = _Tokenizer.from_file(str(path))

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  @property
  def eos_id(self) -> int | None:
    return self._tok.token_to_id(EOS)

  @property
  def mask_id(self) -> int | None:
    return self._tok.token_to_id(MASK)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
