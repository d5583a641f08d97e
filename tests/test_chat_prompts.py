"""Training prompts for instruct targets are made offline and never contain an evaluation prompt."""

import numpy as np

from jetspec_jax import corpus
from jetspec_jax import prompts as prompts_lib
from jetspec_jax.training import chat_prompts


def test_training_and_evaluation_prompts_are_disjoint():
  files = corpus.stdlib_files(corpus.VALIDATION_MODULES)[0]
  coding = chat_prompts.coding_tasks(files, limit=3000, seed=0)
  math = chat_prompts.math_word_problems(3000, seed=0)
  train = set(coding) | set(math)
  assert len(coding) > 1000 and len(set(math)) > 500
  eval_math = chat_prompts.math_word_problems(
    200, seed=1, templates=chat_prompts.EVAL_MATH_TEMPLATES
  )
  assert not train & set(eval_math)
  assert not train & set(chat_prompts.EVAL_CHAT_INSTRUCTIONS)
  # No coding task carries a HumanEval problem's text (names like `add` may coincide; the
  # stdlib docstring a task is made from never equals a HumanEval description).
  training_text = ' '.join(' '.join(task.split()) for task in coding)
  for _, prompt in prompts_lib.humaneval_prompts():
    doc = prompt.split('"""')[1] if '"""' in prompt else prompt.split("'''")[1]
    assert ' '.join(doc.split())[:60] not in training_text
  # Templates share no sentence: a trained template cannot produce an evaluation problem.
  assert not set(chat_prompts.TRAIN_MATH_TEMPLATES) & set(chat_prompts.EVAL_MATH_TEMPLATES)


def test_math_problems_are_deterministic_and_coherent():
  a = chat_prompts.math_word_problems(50, seed=3)
  assert a == chat_prompts.math_word_problems(50, seed=3)
  assert a != chat_prompts.math_word_problems(50, seed=4)
  saving = [p for p in a if 'saves' in p]
  for p in saving:  # the target amount is reachable from the start amount
    nums = [int(w) for w in p.replace('?', ' ').split() if w.isdigit()]
    weekly, target, start = nums
    assert (target - start) % weekly == 0 and target > start
  assert np.mean([len(p) for p in a]) > 40
