"""Shared test set-up: CPU only, float32 matmuls at full precision; the lossless tests' tiny
target, prompts and AR outputs (a module that defines its own fixture of the same name uses
that one)."""

import gc
import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The suite's time is mostly XLA compiling small programs, and nothing in it measures speed: the
# backend's optimisation passes are off (LLVM -O0; about a third less time per compile-bound
# test, measured). Subprocess tests inherit it. JETSPEC_TEST_XLA_OPT=1 keeps XLA's default.
if os.environ.get('JETSPEC_TEST_XLA_OPT') != '1':
  flags = os.environ.get('XLA_FLAGS', '')
  if '--xla_backend_optimization_level' not in flags:
    os.environ['XLA_FLAGS'] = f'{flags} --xla_backend_optimization_level=0'.strip()
# Modules drop their compiled programs (release_compiled_programs) and many compile the same ones
# again (the same tiny target, the same rounds): a persistent compilation cache inside the checkout
# serves those from disk (measured: 258 vs 360 s for three lossless modules, starting empty). A
# fresh clone starts it empty; subprocesses (multihost, notebooks) share it through the
# environment. JETSPEC_TEST_JAX_CACHE='' turns it off.
_cache = os.environ.get(
  'JETSPEC_TEST_JAX_CACHE', os.path.join(os.path.dirname(__file__), '..', '.pytest_cache', 'jax')
)
if _cache:
  os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.abspath(_cache))
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import jax  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')

import pytest  # noqa: E402

import jetspec_jax as js  # noqa: E402

VOCAB = 17  # small, so random heads' drafts are often accepted and commits are exercised


@pytest.fixture(scope='module', autouse=True)
def release_compiled_programs():
  """Drops JAX's compiled programs after each module. Every XLA CPU executable keeps memory
  mappings of its own; a pytest-xdist worker that ran half the suite held ~65,000 of them (Linux's
  default ``vm.max_map_count`` is 65,530, measured), and the next compile then died in a
  segfault. Modules share no compiled programs worth keeping (their fixtures are module-scoped)."""
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope='module')
def target():
  return js.testing.tiny_target(0, vocab_size=VOCAB)


@pytest.fixture(scope='module')
def prompts():
  """Three prompts of different lengths (1, 6, 23 tokens)."""
  return [js.testing.random_ids(10 + n, (n,), VOCAB) for n in (1, 6, 23)]


@pytest.fixture(scope='module')
def ar_outputs(target, prompts):
  """Greedy AR outputs of ``prompts``, 30 tokens: what every lossless method must reproduce."""
  return [
    js.generate(target, None, p, max_new_tokens=30, method=js.methods.AR()).tokens for p in prompts
  ]
