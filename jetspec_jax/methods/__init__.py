"""Decoding methods as values: ``js.generate(target, head, prompts, method=js.methods.Tree())``.

Each method is a frozen dataclass (:class:`Method`) that validates itself on construction, names
the head kinds it runs and is its own round function; one module per method family. The public
names below are the one place a new method is listed; :func:`from_config` builds any of them from
a name or a config mapping (``{'name': 'tree', 'budget': 16}``).
"""

from jetspec_jax.methods import dspark, jetspecpp, tree
from jetspec_jax.methods.ar import AR
from jetspec_jax.methods.base import REGISTRY, Method, from_config
from jetspec_jax.methods.dspark import DSpark
from jetspec_jax.methods.jetspecpp import JetSpecPP
from jetspec_jax.methods.tree import Chain, Tree

__all__ = [
  'AR',
  'REGISTRY',
  'Chain',
  'DSpark',
  'JetSpecPP',
  'Method',
  'Tree',
  'dspark',
  'from_config',
  'jetspecpp',
  'tree',
]
