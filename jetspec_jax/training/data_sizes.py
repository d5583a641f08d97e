"""What a committed token-shard dataset holds, per directory: shards, sequences, tokens and
response tokens, with the provenance of the count; the data card renders it.

  python -m jetspec_jax.training.data_sizes data/smollm2_135m/data data/smollm2_135m/sizes.json
"""

import json
import pathlib
import sys

import numpy as np

from jetspec_jax.evaluation import provenance


def directory_sizes(directory: pathlib.Path) -> dict:
  shards = sorted(directory.glob('shard_*.npz'))
  sequences = tokens = response = 0
  for path in shards:
    with np.load(path) as z:
      lengths = z['lengths']
      sequences += len(lengths)
      tokens += int(lengths.sum())
      response += int(z['loss_mask'].sum())
  return dict(shards=len(shards), sequences=sequences, tokens=tokens, response_tokens=response)


def sizes(data_dir) -> dict:
  """``{'dirs': {relative dir: counts}, 'total': counts}`` over every directory of shards; a
  directory's first shard is the held-out one (``heldout`` counts it alone)."""
  data_dir = pathlib.Path(data_dir)
  dirs = sorted({p.parent for p in data_dir.rglob('shard_*.npz')})
  out = {}
  for d in dirs:
    counts = directory_sizes(d)
    first = sorted(d.glob('shard_*.npz'))[0]
    with np.load(first) as z:
      counts['heldout'] = dict(shard=first.name, sequences=len(z['lengths']))
    out[str(d.relative_to(data_dir))] = counts
  total = {k: sum(v[k] for v in out.values()) for k in ('shards', 'sequences', 'tokens')}
  total['response_tokens'] = sum(v['response_tokens'] for v in out.values())
  return dict(dirs=out, total=total)


def main(argv) -> int:
  if len(argv) != 3:
    print(__doc__)
    return 2
  record = dict(sizes(argv[1]), data_dir=argv[1], provenance=dict(provenance.record()))
  record['provenance']['weights_sha256'] = {}  # a count of committed files reads no weights
  pathlib.Path(argv[2]).write_text(json.dumps(record, indent=1) + '\n')
  print(json.dumps(record['total']))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
