"""Offline chat prompts for training heads on an instruct model, and held-out evaluation prompts.

Three training sources, none of which reads an evaluation prompt:

* **self-written instructions** (Magpie-style): the instruct model, given only its chat template
  up to the start of a user turn, writes a user instruction itself (sampled); the finished ones
  become user turns;
* **coding tasks** made from the standard library's training split: a documented function's
  signature and the first paragraph of its docstring, phrased as a request;
* **math word problems** from templates with random quantities (:data:`TRAIN_MATH_TEMPLATES`).

A ``'tasks'`` prompt round (``chat_data``) draws from three more, in the forms the evaluation
prompts take but never their content:

* **task requests** (:func:`task_requests`): short imperative chat requests (explain, list,
  compare, write a short poem or email, how-to) from templates and topic lists that leave out every
  topic of :data:`EVAL_CHAT_INSTRUCTIONS`;
* **completion tasks** (:func:`completion_tasks`): a standard-library function's signature and
  docstring as a code block to complete (the form of the HumanEval requests);
* more math templates (:data:`TASK_MATH_TEMPLATES`), disjoint from the evaluation ones.

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
# The 'tasks' round's extra templates (with TRAIN_MATH_TEMPLATES): other situations and
# operations than EVAL_MATH_TEMPLATES (no farm animals, laps, tanks or tickets).
TASK_MATH_TEMPLATES = (
  'A box holds {b} eggs. How many boxes are needed for {d} eggs?',
  '{name} has {d} stickers and shares them equally among {b} friends. How many does each friend '
  'get, and how many are left over?',
  'A bus starts with {a} passengers. At the first stop {c} get off and {b} get on. How many '
  'passengers are on the bus now?',
  'A garden is {a} m long and {b} m wide. How much fencing is needed to go around it?',
  'A car uses {c} litres of fuel every 100 km. How much fuel does it use for {d} km?',
  'A library has {d} books. It lends out {a} and buys {b} new ones. How many books does it have '
  'now?',
  'A class of {a} students is split into groups of {b}. How many full groups are there, and how '
  'many students are left over?',
  '{name} earns {a} dollars an hour and works {b} hours a week. How much does {pron_l} earn in '
  '{c} weeks?',
  'A pizza is cut into {b} slices and {name} eats {c} of them. What fraction of the pizza is left?',
  'A square has sides of {a} cm. What are its perimeter and its area?',
  'A jacket costs {d} dollars and is sold at {b} percent off. What is the sale price?',
  'A printer prints {a} pages a minute. How long does it take to print {d} pages?',
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


# Task requests: templates whose {slots} are filled from the lists below. No topic of
# EVAL_CHAT_INSTRUCTIONS is in them (tests/test_chat_data.py checks the key phrases).
_TASK_TEMPLATES = (
  'Explain {concept} in simple terms.',
  'Explain {concept} to {audience}.',
  'What is {concept}, and why does it matter?',
  'How does {concept} work?',
  'Describe {concept} in a short paragraph.',
  'Give me {n} tips for {activity}.',
  'What are some good ways to {goal}?',
  'How can I {goal}?',
  'Suggest {n} ways to {goal}.',
  'Write a short {form} about {subject}.',
  'Write a {form} about {subject} for {audience}.',
  'What are the main differences between {pair}?',
  'Compare {pair} in a few sentences.',
  'List {n} {things}.',
  'Name {n} {things} and say one thing about each.',
  'Summarize {topic} in a few sentences.',
  'Give a brief overview of {topic}.',
  'Write a {tone} email {purpose}.',
  'Write a short message {purpose}.',
  'Suggest a name for {business} and explain why it fits.',
  'How do I {howto} properly?',
  'What are the steps to {howto}?',
  'Why {why}?',
  'Explain {code_concept} in Python with a simple example.',
  'When should I use {code_concept} in Python?',
  'What should I bring to {event}?',
  'Make a checklist for {event}.',
  'Give me a short {cheer} for {occasion}.',
  'Describe a good {routine}.',
)


def _options(text: str) -> tuple[str, ...]:
  return tuple(option.strip() for option in text.split(';'))


_TASK_SLOTS = dict(
  concept=_options(
    'gravity; inflation; the stock market; vaccines; electricity; the internet; a volcano; an '
    "earthquake; the immune system; compound interest; democracy; evolution; DNA; the moon's "
    'phases; tides; a solar eclipse; machine learning; encryption; supply and demand; '
    'magnetism; sound; the Pythagorean theorem; probability; a credit score; renewable energy; '
    'plate tectonics; sleep; memory; friction; atoms; a battery; the seasons; an algorithm; a '
    'computer virus; nuclear energy; taxes; a refrigerator; the human eye; interest rates; a '
    'bicycle gear'
  ),
  audience=_options(
    'a child; a teenager; a complete beginner; my grandmother; a new coworker; a friend who is '
    'not technical; a class of students'
  ),
  n=_options('three; four; five; six; seven'),
  activity=_options(
    'saving money; learning a new language; sleeping better; public speaking; writing a resume; '
    'keeping a houseplant alive; running a first 5k; cooking on a budget; working from home; '
    'making friends in a new city; reducing stress; taking better photos with a phone; keeping '
    'a kitchen clean; learning the guitar; staying safe online; reading more books; training a '
    'puppy; starting a vegetable garden; traveling on a budget; writing clearly; managing time '
    'at work; drinking more water; giving feedback to a coworker; packing light'
  ),
  goal=_options(
    'save energy at home; remember names better; reduce food waste; make a long commute more '
    'pleasant; get better at chess; keep a phone battery healthy; stay productive in the '
    'afternoon; stay warm in winter without a big heating bill; organize a closet; improve my '
    'posture; cut down on sugar; make a small apartment feel bigger; spend less time on my '
    'phone; learn to type faster'
  ),
  form=_options('poem; story; limerick; haiku; song verse; fable; diary entry'),
  subject=_options(
    'a lost umbrella; autumn leaves; a city at dawn; a cat who wants to fly; friendship; a '
    'rainy afternoon; a robot learning to cook; the first day of school; an old bicycle; a '
    'dragon who is afraid of the dark; a busy train station; a garden in spring; the last day '
    'of summer; a kind neighbor; a snowy village'
  ),
  pair=_options(
    'a virus and a bacterium; a stock and a bond; a lake and a pond; a crocodile and an '
    'alligator; RAM and storage; a hurricane and a tornado; baking soda and baking powder; '
    'renting and buying a home; HTTP and HTTPS; a laptop and a tablet; fiction and nonfiction; '
    'a simile and a metaphor; mitosis and meiosis; speed and velocity; a debit card and a '
    'credit card; a set and a dictionary in Python; a city and a town'
  ),
  things=_options(
    'fruits that are high in vitamin C; indoor plants that are easy to care for; board games '
    'for a family night; famous painters; countries in South America; ways to reuse glass jars; '
    'questions to ask at the end of a meeting; classic novels; exercises you can do without '
    'equipment; hobbies that cost little money; programming languages and what they are used '
    'for; animals that live in the desert; things to do on a rainy day; inventions that changed '
    'the world; easy dinner recipes; ways to be kind to a stranger'
  ),
  topic=_options(
    'the history of the printing press; how bees make honey; the life cycle of a butterfly; the '
    'French Revolution; how a bill becomes a law; the story of Romeo and Juliet; the rules of '
    'soccer; how the heart pumps blood; the causes of the First World War; how a car engine '
    'works; the plot of Cinderella; how recycling works; the history of the Olympic Games; how '
    'coffee is grown; how a bank loan works'
  ),
  tone=_options('polite; friendly; formal; short'),
  purpose=_options(
    'asking my manager for a day off; thanking a teacher; inviting neighbors to a barbecue; '
    'asking a landlord to fix a leaking tap; declining a meeting invitation; apologizing for '
    'missing a deadline; welcoming a new team member; asking a friend to return a borrowed '
    'book; requesting a refund for a broken kettle; telling a club that I am stepping down as '
    'treasurer'
  ),
  business=_options(
    'a bicycle repair shop; a dog walking service; a small bookstore; a flower shop; a taco '
    'truck; a yoga studio; a tutoring service; a coffee cart; an online plant shop; a house '
    'cleaning company'
  ),
  howto=_options(
    'boil an egg; iron a shirt; tie a tie; clean a cast iron pan; plant a tree; fix a flat '
    'bicycle tire; wash a wool sweater; sharpen a kitchen knife; back up my computer; bake '
    'bread at home; cook rice on the stove; paint a room'
  ),
  why=_options(
    'do cats purr; do leaves change color in autumn; is the ocean salty; do we dream; do onions '
    'make us cry; does ice float; do we get hiccups; do birds migrate; is exercise good for the '
    'brain; does bread go stale; do we yawn; do some people need glasses'
  ),
  code_concept=_options(
    'a dictionary; a for loop; a list comprehension; exceptions; a class; a decorator; a '
    'generator; f-strings; a while loop; default arguments; the with statement; sorting with a '
    'key function; slicing; modules and imports; a lambda'
  ),
  event=_options(
    'a day at the beach; a picnic in the park; a long flight; a first day at a new job; a ski '
    "trip; a music festival; a road trip; a business conference; a child's birthday party; "
    'moving into a new apartment'
  ),
  cheer=_options('motivational message; word of encouragement; pep talk; congratulations note'),
  occasion=_options(
    'a friend running a marathon; a student before final exams; a colleague starting a new '
    'project; someone learning to drive; my sister who graduated; a team before a big game'
  ),
  routine=_options(
    'evening routine; weekly cleaning routine; routine for a productive workday; bedtime '
    'routine for a toddler; stretching routine for people who sit all day'
  ),
)


def task_requests(n: int, *, seed: int) -> list[str]:
  """``n`` distinct short task requests (deterministic in ``seed``), or all there are if fewer."""
  rng = np.random.default_rng(seed)
  out, seen = [], set()
  for _ in range(50 * n):
    if len(out) == n:
      break
    template = _TASK_TEMPLATES[rng.integers(len(_TASK_TEMPLATES))]
    slots = {
      name: values[rng.integers(len(values))]
      for name, values in _TASK_SLOTS.items()
      if '{' + name + '}' in template
    }
    text = template.format(**slots)
    if text not in seen:
      seen.add(text)
      out.append(text)
  return out


_COMPLETION_PHRASES = (
  'Complete this Python function:\n\n```python\n{src}\n```',
  'Finish the implementation of this Python function:\n\n```python\n{src}\n```',
  'Write the body of this function:\n\n```python\n{src}\n```',
  '```python\n{src}\n```\n\nImplement this function.',
)


@functools.cache
def completable_functions(files: tuple[pathlib.Path, ...]) -> tuple[str, ...]:
  """Source up to the end of the docstring of the public documented functions in ``files``."""
  return tuple(
    source.strip()
    for name, source in prompts_lib.function_prompts(list(files))
    if not name.rsplit('.', 1)[-1].startswith('_')
  )


def completion_tasks(files, *, limit: int, seed: int, skip: int = 0) -> list[str]:
  """Requests to complete a standard-library function given as its signature and docstring in a
  code block (the form of the HumanEval requests): ``limit`` of a fixed shuffle (``seed``)
  after its first ``skip``."""
  sources = completable_functions(tuple(files))
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(sources))[skip : skip + limit]
  return [
    _COMPLETION_PHRASES[rng.integers(len(_COMPLETION_PHRASES))].format(src=sources[i])
    for i in order
  ]


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
