"""The SmolLM2 prompt plan: round 0 reproduces the committed shards' prompts; later rounds
(``data.prompt_rounds``) add prompts that repeat no earlier text or coding task; a ``'tasks'``
round takes the evaluation prompts' forms but none of their topics."""

import pathlib
import re

import ml_collections
import numpy as np
import pytest

from experiments.configs.train import draft_smollm2
from jetspec_jax import corpus
from jetspec_jax.training import chat_data, chat_prompts, run_config
from jetspec_jax.training import shards as shards_lib

DATA = pathlib.Path(__file__).resolve().parents[1] / 'data' / 'smollm2_135m'


@pytest.fixture(scope='module')
def config():
  return draft_smollm2.get_config()


def first_prompts(tokenizer, texts, max_len, every, kind, count):
  """The first ``count`` prompts of one kind, tokenizing no more texts than needed."""
  out, kept = [], 0
  for text in texts:
    ids = chat_prompts.chat_prompt(tokenizer, text)
    if len(ids) > max_len:
      continue
    if (kept % every != 0) == (kind == 'greedy'):
      out.append(ids)
      if len(out) == count:
        return out
    kept += 1
  return out


def assert_first_shards_answer(tokenizer, texts, data_config, data_dir):
  """The first greedy and sampled shards under ``data_dir`` hold the prompts ``texts`` make."""
  for kind in ('greedy', 'sampled'):
    shard = np.load(data_dir / kind / 'shard_00000.npz')
    stored = [
      list(tokens[: int(np.argmax(mask > 0))])
      for tokens, mask in zip(shard['tokens'], shard['loss_mask'])
    ]
    made = first_prompts(
      tokenizer, texts, data_config.max_prompt_len, data_config.sampled_every, kind, len(stored)
    )
    assert [list(p) for p in made] == stored, kind


def test_round0_reproduces_the_committed_shards(config):
  tokenizer = run_config.tokenizer_for(config.target)
  instructions = chat_data.instructions_from_shards(
    sorted((DATA / 'instructions').glob('shard_*.npz')), tokenizer
  )
  texts = chat_data.training_texts(instructions, config.data, seed=config.seed)
  assert_first_shards_answer(tokenizer, texts, config.data, DATA / 'data')


def test_round2_reproduces_its_committed_shards(config):
  """The 'tasks' round's committed shards answer the prompts its plan makes after rounds 0-1."""
  tokenizer = run_config.tokenizer_for(config.target)
  seen = set()
  for prompt_round, folder in ((0, 'instructions'), (1, 'instructions_round1')):
    instructions = chat_data.instructions_from_shards(
      sorted((DATA / folder).glob('shard_*.npz')), tokenizer
    )
    texts = chat_data.training_texts(
      instructions, config.data, seed=config.seed, prompt_round=prompt_round, exclude=seen
    )
    seen.update(t.lower() for t in texts)
  texts = chat_data.training_texts([], config.data, seed=config.seed, prompt_round=2, exclude=seen)
  assert_first_shards_answer(tokenizer, texts, config.data, DATA / 'data' / 'round2')


def test_later_rounds_repeat_no_text_or_coding_task():
  data = ml_collections.ConfigDict(
    dict(num_coding=40, num_math=60, validation_modules=corpus.VALIDATION_MODULES)
  )
  instructions = [['Name a color.', 'Write a haiku.'], ['write a haiku.', 'Name a fruit.']]
  round0 = chat_data.training_texts(instructions[0], data, seed=0)
  assert chat_data.training_texts(instructions[0], data, seed=0, exclude={'x'}) == round0
  round1 = chat_data.training_texts(
    instructions[1], data, seed=0, prompt_round=1, exclude={t.lower() for t in round0}
  )
  assert round1 == chat_data.training_texts(
    instructions[1], data, seed=0, prompt_round=1, exclude={t.lower() for t in round0}
  )
  assert not {t.lower() for t in round0} & {t.lower() for t in round1}
  assert 'Name a fruit.' in round1 and 'write a haiku.' not in round1  # case-blind
  assert len(round1) > 90  # new math problems and a fresh slice of coding tasks
  # Round 1's coding tasks are the next slice of the same shuffle: other functions (every
  # phrasing ends with the function's docstring summary).
  files = corpus.stdlib_files(corpus.VALIDATION_MODULES)[0]
  coding0 = chat_prompts.coding_tasks(files, limit=40, seed=0)
  coding1 = chat_prompts.coding_tasks(files, limit=40, seed=0, skip=40)
  assert set(coding0) <= set(round0) and set(coding1) <= set(round1)
  assert not {t[-40:] for t in coding0} & {t[-40:] for t in coding1}


# The topic of each of EVAL_CHAT_INSTRUCTIONS, in its order: no training task request names one.
EVAL_CHAT_TOPICS = (
  'studying',
  'black hole',
  'the sea',
  'tuple',
  'water cycle',
  'bakery',
  'tea',
  'report',
  'photosynthesis',
  'breakfast',
  'climate',
  'morning',
  'hiking',
  'recursion',
  'sky',
  'interview',
)


def test_task_requests_leave_out_the_evaluation_topics():
  assert len(EVAL_CHAT_TOPICS) == len(chat_prompts.EVAL_CHAT_INSTRUCTIONS)
  for topic, instruction in zip(EVAL_CHAT_TOPICS, chat_prompts.EVAL_CHAT_INSTRUCTIONS):
    assert topic in instruction.lower()  # the list above names each instruction's topic
  requests = chat_prompts.task_requests(3000, seed=0)
  assert len(requests) == len(set(requests)) > 1500
  assert requests == chat_prompts.task_requests(3000, seed=0)
  assert requests[:100] != chat_prompts.task_requests(100, seed=1)
  topics = re.compile(r'\b(' + '|'.join(EVAL_CHAT_TOPICS) + r')\b')
  for request in requests:
    assert not topics.search(request.lower()), request
  assert not set(chat_prompts.TASK_MATH_TEMPLATES) & set(chat_prompts.EVAL_MATH_TEMPLATES)


def test_a_tasks_round_keeps_the_chat_rounds_and_adds_the_evaluation_forms():
  data = ml_collections.ConfigDict(
    dict(
      num_coding=40,
      num_math=60,
      num_task_requests=50,
      validation_modules=corpus.VALIDATION_MODULES,
      round_mixes=('chat', 'chat', 'tasks'),
    )
  )
  plain = ml_collections.ConfigDict({k: v for k, v in data.items() if k != 'round_mixes'})
  instructions = ['Name a color.', 'Write a haiku.']
  for r in (0, 1):  # the chat rounds are the plan they were before round_mixes existed
    assert chat_data.training_texts(instructions, data, seed=0, prompt_round=r) == (
      chat_data.training_texts(instructions, plain, seed=0, prompt_round=r)
    )
  texts = chat_data.training_texts(instructions, data, seed=0, prompt_round=2)
  assert 'Name a color.' not in texts  # no self-written instructions
  files = corpus.stdlib_files(corpus.VALIDATION_MODULES)[0]
  completions = chat_prompts.completion_tasks(files, limit=40, seed=0)
  assert set(completions) <= set(texts) and len(texts) == 50 + 40 + 60
  assert all('```python\n' in t and 'def ' in t for t in completions)
  # the math problems come from both template sets (the extra ones' first words)
  assert any(t.startswith('A box holds') or t.startswith('A jacket costs') for t in texts)
  assert set(chat_prompts.task_requests(50, seed=2000)) <= set(texts)  # round 2's seed
  with pytest.raises(ValueError, match='unknown prompt mix'):
    chat_data.round_mix(ml_collections.ConfigDict(dict(round_mixes=('chat', 'code'))), 1)


def test_round_dirs():
  assert chat_data.round_dirs('w', 'w/data', 0) == (
    pathlib.Path('w/instructions'),
    pathlib.Path('w/data'),
  )
  assert chat_data.round_dirs('w', 'w/data', 2) == (
    pathlib.Path('w/instructions_round2'),
    pathlib.Path('w/data/round2'),
  )


def test_shard_paths_keep_the_first_prompt_rounds(tmp_path):
  for rel in ('greedy', 'sampled', 'round1/greedy', 'round2/sampled', 'roundabout'):
    (tmp_path / rel).mkdir(parents=True)
    (tmp_path / rel / 'shard_00000.npz').touch()
  names = lambda paths: [str(p.relative_to(tmp_path).parent) for p in paths]
  everything = ['greedy', 'round1/greedy', 'round2/sampled', 'roundabout', 'sampled']
  assert names(shards_lib.shard_paths(tmp_path)) == everything
  assert names(shards_lib.shard_paths(tmp_path, 1)) == ['greedy', 'roundabout', 'sampled']
  assert names(shards_lib.shard_paths(tmp_path, 2)) == [
    'greedy',
    'round1/greedy',
    'roundabout',
    'sampled',
  ]


@pytest.mark.parametrize('kind', ['jetspec', 'dflash', 'jetspecpp', 'dspark'])
def test_public_and_block16_presets_build(kind):
  """'<head>_public' continues the shipped head on rounds 0-2 plus the public-chat data (its own
  width); '<head>_b16' keeps a step's draft slots (anchors x block) equal to the first stage's."""
  public = draft_smollm2.get_config(f'{kind}_public')
  run_config.check_config(public)
  assert public.train.init_from == f'assets/{kind}_head_smollm2_135m'
  assert public.data.prompt_rounds == 3
  assert [m['dir'] for m in public.data.mix] == ['data/public_chat']
  assert public.head.causal == draft_smollm2.get_config(kind).head.causal
  assert public.data.mix[0]['features_compute_dtype'] == 'bfloat16'  # a field of its own
  public.data.mix = [dict(public.data.mix[0], width=3)]  # one of no meaning is refused
  with pytest.raises(ValueError, match='each data.mix entry'):
    run_config.check_config(public)
  if kind in ('jetspec', 'dflash'):
    first, b16 = draft_smollm2.get_config(kind), draft_smollm2.get_config(f'{kind}_b16')
    run_config.check_config(b16)
    assert b16.head.block_size == 16 and b16.head.causal == first.head.causal
    assert b16.train.num_anchors * 16 == first.train.num_anchors * first.head.block_size
  else:
    with pytest.raises(ValueError, match='blocks of 16'):
      draft_smollm2.get_config(f'{kind}_b16')
