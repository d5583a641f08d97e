"""The peer a CPU user would try first: transformers' own ``generate`` on the same GGUF file.

Greedy decoding, and prompt-lookup decoding (``prompt_lookup_num_tokens``: drafts copied from
n-gram matches in the prompt, verified by the model; lossless). torch and transformers are
test-only dependencies (``pip install -e .[dev]``), imported here only when a benchmark asks for
peers.
"""

import pathlib
import time
from collections.abc import Sequence

import numpy as np

MODES = ('greedy', 'prompt_lookup')


def transformers_generate(
  model_path: str,
  prompts: Sequence[Sequence[int]],
  *,
  max_new_tokens: int,
  eos_ids: Sequence[int],
  modes: Sequence[str] = MODES,
  prompt_lookup_num_tokens: int = 10,
  threads: int | None = None,
) -> dict[str, dict]:
  """``{mode: {'tokens': [ids per prompt], 'wall_s': [...], 'tps', 'wall_total_s'}}``.

  ``model_path`` is a ``.gguf`` file (dequantized to float32 by transformers) or an HF
  directory. Each mode decodes the first prompt once as a warm-up, then every prompt, timed.
  """
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ImportError(
      'the transformers peer needs the test-only dependencies: pip install -e ".[dev]"'
    ) from e
  for mode in modes:
    if mode not in MODES:
      raise ValueError(f'peer mode must be one of {MODES}, got {mode!r}')
  if threads:
    torch.set_num_threads(threads)
  path = pathlib.Path(model_path)
  if path.suffix == '.gguf':
    model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
  else:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
  model.eval()
  eos = list(eos_ids)
  results = {}
  for mode in modes:
    extra = dict(prompt_lookup_num_tokens=prompt_lookup_num_tokens) if mode != 'greedy' else {}

    def decode(prompt, extra=extra):
      ids = torch.tensor([list(prompt)], dtype=torch.long)
      start = time.perf_counter()
      with torch.no_grad():
        out = model.generate(
          ids,
          attention_mask=torch.ones_like(ids),
          max_new_tokens=max_new_tokens,
          do_sample=False,
          eos_token_id=eos,
          pad_token_id=eos[0],
          **extra,
        )
      wall = time.perf_counter() - start
      return out[0, ids.shape[1] :].numpy(), wall

    decode(prompts[0])  # warm-up
    outs = [decode(p) for p in prompts]
    tokens = [np.asarray(t) for t, _ in outs]
    walls = [w for _, w in outs]
    results[mode] = dict(
      tokens=[t.tolist() for t in tokens],
      wall_s=walls,
      wall_total_s=float(sum(walls)),
      new_tokens=int(sum(len(t) for t in tokens)),
      tps=sum(len(t) for t in tokens) / sum(walls),
    )
  return results


def agreement(ours: Sequence[np.ndarray], theirs: Sequence[Sequence[int]]) -> float:
  """Mean fraction of the leading tokens two greedy decodings share (float32 rounding in two
  frameworks may part them late in a long output; the leading run should match)."""
  fractions = []
  for a, b in zip(ours, theirs, strict=True):
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    same = np.flatnonzero(a[:n] != b[:n])
    run = int(same[0]) if same.size else n
    fractions.append(run / max(n, 1))
  return float(np.mean(fractions))
