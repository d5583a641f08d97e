"""Training checkpoints (Orbax): params, optimizer state, step and data position.

Resume order, first that exists wins: (1) the latest checkpoint in ``workdir/checkpoints``;
(2) ``init_from``: a released-layout head directory whose weights start the run (fresh optimizer,
step 0); (3) scratch. Restores go against an abstract state (shapes, dtypes, shardings), so a
checkpoint written on one device layout restores onto another.
"""

import logging as py_logging
import os

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

# Orbax logs a dozen INFO lines per save and restore through absl; they drown the training log.
# Set JETSPEC_ORBAX_LOGS=1 to see them.
ORBAX_LOGS_ENV = 'JETSPEC_ORBAX_LOGS'


class _QuietOrbax(py_logging.Filter):
  """Drops Orbax's records below WARNING (its source files live under ``orbax/``)."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    from_orbax = f'{os.sep}orbax{os.sep}' in record.pathname
    return not from_orbax or record.levelno >= py_logging.WARNING


def quiet_orbax() -> None:
  """Installs the filter on absl's logger once (unless ``JETSPEC_ORBAX_LOGS`` is set)."""
  logger = logging.get_absl_logger()
  if os.environ.get(ORBAX_LOGS_ENV) or any(isinstance(f, _QuietOrbax) for f in logger.filters):
    return
  logger.addFilter(_QuietOrbax())


def manager(workdir: str | os.PathLike, *, max_to_keep: int = 3) -> ocp.CheckpointManager:
  quiet_orbax()
  directory = epath.Path(workdir) / 'checkpoints'
  if '://' not in str(workdir):  # a local path (gs:// and the like stay as they are)
    directory = directory.absolute()
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
  return ocp.CheckpointManager(directory, options=options)


def save(mngr: ocp.CheckpointManager, step: int, state) -> None:
  """Saves ``state`` (a pytree of arrays) at ``step`` and waits until it is on disk."""
  mngr.save(step, args=ocp.args.StandardSave(state))
  mngr.wait_until_finished()


def restore_latest(mngr: ocp.CheckpointManager, abstract_state):
  """The latest checkpoint restored onto ``abstract_state``'s structure, or None."""
  step = mngr.latest_step()
  if step is None:
    return None
  logging.info('restoring checkpoint at step %d from %s', step, mngr.directory)
  return mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))


def abstract_like(state):
  """Shape/dtype/sharding structs of a concrete state (the restore target)."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
