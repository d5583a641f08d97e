"""Pictures for notebooks: a draft tree with its accepted path, and attention masks."""

import numpy as np


def draw_tree(tree, labels, accepted=(), ax=None, max_nodes: int | None = None):
  """Draws a :class:`jetspec_jax.tree.Tree` top-down, one row per depth.

  Args:
    tree: the tree (no batch axis).
    labels: ``labels[i]`` is node ``i``'s text (e.g. its decoded token).
    accepted: node indices of the accepted path (drawn highlighted).
    ax: a matplotlib axis (created if None).
    max_nodes: draw only the first nodes.
  """
  import matplotlib.pyplot as plt

  n = int(tree.num_nodes) if max_nodes is None else min(int(tree.num_nodes), max_nodes)
  parents = np.asarray(tree.parents)[:n]
  depths = np.asarray(tree.depths)[:n]
  if ax is None:
    _, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * depths.max()))
  x = np.zeros(n)
  for d in range(depths.max() + 1):
    nodes = np.flatnonzero(depths == d)
    x[nodes] = np.linspace(0, 1, len(nodes) + 2)[1:-1]
  accepted = set(int(i) for i in accepted)
  for i in range(1, n):
    on_path = i in accepted and parents[i] in accepted
    ax.plot(
      [x[parents[i]], x[i]],
      [-depths[parents[i]], -depths[i]],
      color='tab:green' if on_path else '0.75',
      lw=2.5 if on_path else 0.8,
      zorder=1,
    )
  for i in range(n):
    ax.text(
      x[i],
      -depths[i],
      repr(labels[i])[1:-1] or ' ',
      ha='center',
      va='center',
      fontsize=7,
      bbox=dict(
        boxstyle='round,pad=0.2', fc='tab:green' if i in accepted else 'white', ec='0.4', alpha=0.9
      ),
      zorder=2,
    )
  ax.set_ylim(-depths.max() - 0.6, 0.6)
  ax.set_yticks(-np.arange(depths.max() + 1), [f'depth {d}' for d in range(depths.max() + 1)])
  ax.set_xticks([])
  for side in ('top', 'right', 'bottom'):
    ax.spines[side].set_visible(False)
  return ax


def draw_mask(mask, ax=None, title: str = ''):
  """Shows a boolean mask (rows attend to the dark columns)."""
  import matplotlib.pyplot as plt

  if ax is None:
    _, ax = plt.subplots(figsize=(4, 4))
  ax.imshow(np.asarray(mask), cmap='Greys', interpolation='nearest')
  ax.set(xlabel='key', ylabel='query', title=title)
  return ax
