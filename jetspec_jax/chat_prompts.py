"""Offline chat prompts for training heads on an instruct model, and held-out evaluation prompts.

Three training sources, none of which reads an evaluation prompt:

* **self-written instructions** (Magpie-style): the instruct model, given only its chat template
  up to the start of a user turn, writes a user instruction itself (sampled); the finished ones
  become user turns;
* **coding tasks** made from the standard library's training split: a documented function's
  signature and the first paragraph of its docstring, phrased as a request;
* **math word problems** from templates with random quantities (:data:`TRAIN_MATH_TEMPLATES`).

Evaluation uses HumanEval (code), :data:`EVAL_CHAT_INSTRUCTIONS` (chat, written for evaluation
only) and :func:`math_word_problems` with the disjoint :data:`EVAL_MATH_TEMPLATES`.
"""

import ast
import functools
import pathlib

import numpy as np

from jetspec_jax import corpus
from jetspec_jax import prompts as prompts_lib

_PLACEHOLDER = '\x00USER\x00'


def user_turn_prefix(tokenizer) -> list[int]:
  """Token ids of the chat template up to where a user's message text would start."""
  text = tokenizer.render_chat([{'role': 'user', 'content': _PLACEHOLDER}], False)
  if _PLACEHOLDER not in text:
    raise ValueError('the chat template does not place the user message verbatim')
  return tokenizer.encode(text[: text.index(_PLACEHOLDER)])


def chat_prompt(tokenizer, instruction: str) -> list[int]:
  """A single user turn with the assistant's turn opened (the generation prompt)."""
  return tokenizer.apply_chat_template([{'role': 'user', 'content': instruction}])


def clean_instruction(text: str, *, min_chars: int = 12, max_chars: int = 600) -> str | None:
  """A self-written instruction if it is usable (finished, of a sensible length), else None."""
  text = text.strip()
  if not min_chars <= len(text) <= max_chars or '<|' in text:
    return None
  return text


_CODE_PHRASES = (
  'Write a Python function `{sig}` that does the following: {doc}',
  'Implement `{sig}` in Python. {doc}',
  'Can you write a Python function {sig}? It should work like this: {doc}',
  'Please write the Python function `{sig}`.\n\n{doc}',
)


@functools.cache
def documented_functions(files: tuple[pathlib.Path, ...]) -> tuple[tuple[str, str], ...]:
  """``(signature, docstring summary)`` of the public documented functions in ``files``."""
  functions = []
  for _, source in prompts_lib.function_prompts(list(files)):
    try:
      node = ast.parse(source).body[0]  # a body of just the docstring is valid
    except SyntaxError:
      continue
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith('_'):
      continue
    doc = ast.get_docstring(node) or ''
    summary = ' '.join(doc.split('\n\n')[0].split())
    if len(summary) < 20 or '>>>' in summary:  # too short, or a doctest rather than prose
      continue
    args = ast.unparse(node.args)
    if args.startswith('self'):
      args = args[4:].lstrip(', ')
    functions.append((f'{node.name}({args})', summary))
  return tuple(functions)


def coding_tasks(files, *, limit: int, seed: int, skip: int = 0) -> list[str]:
  """Requests to write documented standard-library functions (signature + docstring summary):
  ``limit`` functions of a fixed shuffle (``seed``) after its first ``skip``, so successive
  prompt rounds (``skip = round * limit``) never ask for the same function twice."""
  tasks = documented_functions(tuple(files))
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(tasks))[skip : skip + limit]
  return [
    _CODE_PHRASES[rng.integers(len(_CODE_PHRASES))].format(sig=tasks[i][0], doc=tasks[i][1])
    for i in order
  ]


TRAIN_MATH_TEMPLATES = (
  '{name} has {a} apples. {pron} buys {b} more and then gives {c} to a friend. '
  'How many apples does {name} have now?',
  'A train travels {a} km in {b} hours. What is its average speed in km per hour?',
  'A shop sells pencils at {a} cents each. How much do {b} pencils cost in cents?',
  '{name} reads {a} pages a day. How many pages does {pron_l} read in {b} days?',
  'A rectangle is {a} cm long and {b} cm wide. What is its area?',
  'There are {a} students in a class and {b} of them are absent. How many are present?',
  '{name} saves {a} dollars every week. How many weeks until {pron_l} has {d} dollars '
  'if {pron_l} starts with {b} dollars?',
  'A baker makes {a} loaves in the morning and {b} in the afternoon. '
  'If {c} are sold, how many are left?',
)
EVAL_MATH_TEMPLATES = (
  'A farmer has {a} sheep and {b} cows. Each sheep eats {c} kg of hay a day and each cow twice '
  'as much. How much hay do the animals eat in one day?',
  '{name} runs {a} laps of a {b} m track. How many kilometres does {pron_l} run?',
  'A tank holds {a} litres and leaks {b} litres an hour. After {c} hours, how much is left?',
  'Tickets cost {a} dollars for adults and {b} dollars for children. What do {c} adults and '
  '2 children pay in total?',
)
_NAMES = (('Ana', 'She'), ('Ben', 'He'), ('Chen', 'He'), ('Dara', 'She'), ('Eli', 'He'))


def math_word_problems(n: int, *, seed: int, templates=TRAIN_MATH_TEMPLATES) -> list[str]:
  """``n`` word problems from ``templates`` with random quantities (deterministic in ``seed``)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    name, pron = _NAMES[rng.integers(len(_NAMES))]
    a, b = int(rng.integers(3, 60)), int(rng.integers(2, 20))
    c = int(rng.integers(1, min(a, b) + 1))
    d = b + a * int(rng.integers(2, 12))
    template = templates[rng.integers(len(templates))]
    out.append(template.format(name=name, pron=pron, pron_l=pron.lower(), a=a, b=b, c=c, d=d))
  return out


EVAL_CHAT_INSTRUCTIONS = (
  'Give me three tips for staying focused while studying.',
  'Explain what a black hole is to a ten-year-old.',
  'Write a short poem about the sea at night.',
  'What are the main differences between a list and a tuple in Python?',
  'Summarize the water cycle in a few sentences.',
  'Suggest a name for a small bakery and explain why it fits.',
  'How do I make a cup of green tea properly?',
  'Write a polite email asking a colleague to review my report.',
  'What is photosynthesis and why does it matter?',
  'List five healthy breakfast ideas.',
  'Explain the difference between weather and climate.',
  'Describe a good morning routine in a short paragraph.',
  'What should I pack for a weekend hiking trip?',
  'Explain recursion with a simple example.',
  'Why is the sky blue?',
  'Give me a short motivational message for a job interview.',
)


def stdlib_train_files(validation_modules=()) -> list[pathlib.Path]:
  """The standard library's training split (the same split the embedded code model uses)."""
  return corpus.stdlib_files(tuple(validation_modules))[0]


def eval_prompt_groups(tokenizer, *, num_code: int = 16, num_math: int = 16, seed: int = 1):
  """Held-out evaluation prompts, chat-formatted: ``{'code', 'chat', 'math'} -> [ids]``.

  Code: HumanEval problems as a request to complete the function; chat:
  :data:`EVAL_CHAT_INSTRUCTIONS`; math: :data:`EVAL_MATH_TEMPLATES` (disjoint from training).
  """
  code = [
    'Complete this Python function:\n\n```python\n' + prompt.strip() + '\n```'
    for _, prompt in prompts_lib.humaneval_prompts(num_code)
  ]
  math = math_word_problems(num_math, seed=seed, templates=EVAL_MATH_TEMPLATES)
  groups = {'code': code, 'chat': list(EVAL_CHAT_INSTRUCTIONS), 'math': math}
  return {name: [chat_prompt(tokenizer, text) for text in texts] for name, texts in groups.items()}
