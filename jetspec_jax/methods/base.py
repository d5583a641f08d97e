"""A decoding method is a value: a frozen dataclass that validates itself, names the head kinds it
runs, and is its own round function.

``js.generate(target, head, prompts, method=js.methods.Tree(budget=16))`` takes one such value;
the arguments every method shares (sampling, stop ids, shapes) stay on ``generate``. A speculative
method is static and hashable, so :func:`jetspec_jax.rounds.speculative_loop` compiles one
program per method value, and calling it runs one round::

  method(target, head, state, sampling, round_data) -> (state, RoundOutput)

Optional hooks the loop reads: ``init_state(head, state)`` (a method that carries more state),
``stat_names`` (its per-round counters) and ``keeps_history`` (it reads the committed tokens).

Adding a method is one module under ``jetspec_jax/methods/`` with a :class:`Method` subclass
(its ``name`` registers it for :func:`from_config`) and one import line in
``jetspec_jax/methods/__init__.py``.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

# name -> method class, filled by Method.__init_subclass__.
REGISTRY: dict[str, type['Method']] = {}


@dataclasses.dataclass(frozen=True)
class Method:
  """Base of the method values.

  Class attributes:
    name: the method's name in configs (``from_config({'name': ...})``) and benchmark labels.
    head_kinds: the draft head kinds (``DraftHeadConfig.kind``) it runs; ``()`` takes no head.
  """

  name: ClassVar[str] = ''
  head_kinds: ClassVar[tuple[str, ...]] = ()

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.name:
      if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f'two methods are named {cls.name!r}')
      REGISTRY[cls.name] = cls

  def check_head(self, head) -> None:
    """Raises ValueError unless ``head`` is a head this method runs."""
    if not self.head_kinds:
      return
    if head is None:
      raise ValueError(f'{self} needs a draft head')
    if head.cfg.kind not in self.head_kinds:
      raise ValueError(
        f'{self} cannot run a {head.cfg.kind} head (it runs {", ".join(self.head_kinds)} heads)'
      )

  def make_round(self, target, head) -> tuple['Method', int]:
    """The round function for this target and head (checked against both), and how many nodes
    past the committed prefix one of its rounds may write (``overhang``)."""
    raise NotImplementedError(f'{type(self).__name__} has no speculative round')

  def round_data(self, target, head, batch_size: int, capacity: int):
    """Arrays the round reads (e.g. a profiled table), or None."""
    del target, head, batch_size, capacity
    return None

  def to_config(self) -> dict:
    """``{'name': ..., field: value, ...}``: what :func:`from_config` turns back into ``self``."""
    return dict(name=self.name, **dataclasses.asdict(self))


def from_config(config: 'Method | str | Mapping[str, Any]') -> Method:
  """A method from a config: a method value (returned as is), a name (``'tree'``: its defaults),
  or a mapping (a dict or ``ml_collections.ConfigDict``) of ``name`` and the method's fields,
  e.g. ``{'name': 'tree', 'budget': 16, 'width': 7}``."""
  if isinstance(config, Method):
    return config
  if isinstance(config, str):
    config = {'name': config}
  if hasattr(config, 'to_dict'):  # ml_collections.ConfigDict
    config = config.to_dict()
  if not isinstance(config, Mapping):
    raise TypeError(f'a method config is a Method, a name or a mapping, got {type(config)}')
  fields = dict(config)
  name = fields.pop('name', None)
  if name not in REGISTRY:
    raise ValueError(f'method name must be one of {sorted(REGISTRY)}, got {name!r}')
  cls = REGISTRY[name]
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f'{name!r} has no setting {unknown} (its settings: {sorted(known)})')
  # A config read back from JSON holds lists where the method holds tuples (a method is a static,
  # hashable argument of the compiled loop).
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
  return cls(**fields)
