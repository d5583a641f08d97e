"""The target's greedy responses to public prompts, generated once and stored (JSON lines).

Tau of greedy decoding is a property of (prompt, head, method, the target's greedy response):
the response is generated here once per prompt by batched autoregressive decoding (rows refilled
as responses end, :mod:`jetspec_jax.evaluation.refill`), and every head and tree setting is then
walked along it (:mod:`jetspec_jax.evaluation.tree_walk`). A responses file holds one record per
prompt, appended as each response ends, so an interrupted run resumes where it stopped (records
already there are skipped).
"""

import hashlib
import json
import pathlib

import numpy as np

from jetspec_jax.evaluation import prompt_sets, refill


def ids_sha256(ids) -> str:
  """sha256 of token ids as little-endian int32 (the hash result files record)."""
  return hashlib.sha256(np.asarray(ids, '<i4').tobytes()).hexdigest()


def prompt_ids(tok, prompt: prompt_sets.Prompt) -> np.ndarray:
  """The prompt's token ids: its messages in the target's chat template."""
  return np.asarray(tok.apply_chat_template(list(prompt.messages)), np.int32)


def read(path) -> dict[tuple[str, str], dict]:
  """(benchmark, prompt_id) -> record of a responses file (empty when there is none); a last
  line cut off by a crash is ignored."""
  path = pathlib.Path(path)
  out = {}
  if not path.exists():
    return out
  for line in path.read_text().splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue  # a partial last line: regenerated
    out[record['benchmark'], record['prompt_id']] = record
  return out


def generate(
  target,
  tok,
  prompts: list[prompt_sets.Prompt],
  path,
  *,
  max_new_tokens: int,
  batch_size: int = 8,
) -> list[dict]:
  """Greedy responses of ``prompts`` appended to ``path`` as each ends (those already there are
  skipped), ``batch_size`` cache rows decoded side by side and refilled as responses end
  (:mod:`jetspec_jax.evaluation.refill`); returns the new records."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  done = read(path)
  todo = [p for p in prompts if (p.benchmark, p.prompt_id) not in done]
  ids = [prompt_ids(tok, p) for p in todo]
  new = []

  def store(result: refill.Finished) -> None:
    p, pid = todo[result.index], ids[result.index]
    response = [int(t) for t in result.tokens]
    record = dict(
      **p.to_json(),
      prompt_sha256=ids_sha256(pid),
      prompt_len=int(len(pid)),
      response=response,
      response_sha256=ids_sha256(response),
      stopped=bool(response and response[-1] in tok.eos_ids),
      generate_s=round(result.seconds, 3),
      rows=batch_size,
    )
    new.append(record)
    with path.open('a') as f:
      f.write(json.dumps(record) + '\n')

  refill.generate(
    target,
    ids,
    max_new_tokens=max_new_tokens,
    eos=tok.eos_ids,
    rows=batch_size,
    on_finished=store,
  )
  return new
