"""Each experiment task runs end to end on its tiny config; the verb binaries dispatch to them."""

import importlib
import json
import os
import pathlib

import numpy as np
import pytest

import jetspec_jax as js
from experiments.configs.benchmark import code_small as benchmark_config
from experiments.configs.demo import main_job as demo_config
from experiments.configs.train import draft_qwen3_8b, draft_tiny, target_code_small
from experiments.tasks import decode_benchmark, demo, generate_data

ASSETS = {
  'target': 'assets/target_code_small',
  'jetspec': 'assets/jetspec_head_code_small',
  'dflash': 'assets/dflash_head_code_small',
}


def test_assets_load_and_shipped_heads_are_lossless():
  """The embedded default loads; greedy tree == ar on a few HumanEval prompts, both heads."""
  from jetspec_jax import prompts
  from jetspec_jax.tokenizer import Tokenizer

  target = js.load_target(ASSETS['target'])
  tok = Tokenizer(ASSETS['target'])
  assert tok.vocab_size == target.cfg.vocab_size and tok.eos_id == target.cfg.eos_token_id
  for name in ('jetspec', 'dflash'):
    head = js.load_draft_head(ASSETS[name], target)
    assert head.cfg.causal == (name == 'jetspec') and head.cfg.mask_token_id == tok.mask_id
    for _, text in prompts.humaneval_prompts(2):
      ids = tok.encode(text)
      want = js.generate(target, None, ids, max_new_tokens=24, method=js.methods.AR()).tokens
      out = js.generate(
        target, head, ids, max_new_tokens=24, method=js.methods.Tree(budget=16, width=5)
      )
      np.testing.assert_array_equal(out.tokens, want)


def test_demo_runs_on_tiny_config(tmp_path):
  results = demo.run(demo_config.get_config('tiny'), str(tmp_path))
  assert set(results) == {'ar', 'chain', 'tree', 'tree+copy', 'ar/bfloat16x2', 'tree/bfloat16x2'}
  saved = json.loads((tmp_path / 'demo.json').read_text())
  fields = {'tau', 'tps', 'wall_s', 'tokens', 'speedup', 'tau_histogram'}
  for name in ('ar', 'chain', 'tree', 'ar/bfloat16x2', 'tree/bfloat16x2'):
    assert set(saved['methods'][name]) == fields
  assert set(saved['methods']['tree+copy']) == fields | {'round_stats', 'copy_share'}
  assert saved['methods']['tree']['tau'] >= 1.0 and (tmp_path / 'demo_tau.png').exists()


def test_benchmark_runs_on_tiny_config(tmp_path):
  result = decode_benchmark.run(benchmark_config.get_config('tiny'), str(tmp_path))
  saved = json.loads((tmp_path / 'benchmark.json').read_text())
  assert {r['batch'] for r in saved['batch_rows']} == {1, 2}
  assert set(saved['provenance']) >= {'commit', 'dirty', 'command', 'date_utc', 'cpu', 'versions'}
  assert set(saved) == {
    'provenance',
    'batch_rows',
    'config',
    'device',
    'backend',
    'cpu',
    'versions',
    'num_prompts',
    'rows',
    'per_prompt',
    'peer_rows',
    'round_cost_rows',
  }
  (cost,) = saved['round_cost_rows']  # the head's share of a round, measured
  assert cost['setting'] == 'tree/jetspec/accum_logp/8' and cost['batch'] == 1
  assert 0 < cost['draft_ms'] < cost['round_ms'] and 0 < cost['draft_share'] < 1
  settings = {r['setting'] for r in result['rows']}
  assert {'ar', 'chain/jetspec', 'chain/dflash', 'tree/jetspec/accum_logp/8'} <= settings
  for row in saved['rows']:
    assert {'temperature', 'setting', 'tau', 'tps', 'speedup', 'tau_histogram'} <= set(row)
    assert set(row['groups']) == {'humaneval', 'heldout'}
  assert (tmp_path / 'benchmark.md').exists() and (tmp_path / 'benchmark.png').exists()


def test_benchmark_times_every_greedy_setting_on_a_second_target_precision(tmp_path):
  config = benchmark_config.get_config('tiny')
  config.update(temperatures=(0.0,), batch_sizes=(), round_cost_batches=(), peers=())
  config.targets = ('float32', 'bfloat16x2')
  result = decode_benchmark.run(config, str(tmp_path))
  by_target = {}
  for r in result['rows']:
    by_target.setdefault(r['target'], []).append(r)
  f32 = {r['setting'] for r in by_target['float32']}
  assert {r['setting'] for r in by_target['bfloat16x2']} == {f'bfloat16x2:{s}' for s in f32}
  prompts = sum(result['num_prompts'].values())
  for r in by_target['bfloat16x2']:
    assert 0 <= r['equal_to_float32_ar'] <= prompts and r['speedup'] > 0
  labels = {(p['target'], p['setting']) for p in result['per_prompt']}
  assert ('bfloat16x2', 'bfloat16x2:ar') in labels and ('float32', 'ar') in labels
  assert set(result['provenance']['weights_sha256']) == {'target', 'jetspec', 'dflash'}
  config.targets = ('bfloat16x2',)
  with pytest.raises(ValueError, match='start with float32'):
    decode_benchmark.run(config, str(tmp_path))


def test_tree_attention_benchmark_runs_on_tiny_config(tmp_path):
  from experiments.configs.microbench import tree_attention
  from experiments.tasks import kernel_bench

  result = kernel_bench.run(tree_attention.get_config('tiny'), str(tmp_path))
  assert len(result['rows']) == 2 and all(r['kernel_ms'] > 0 for r in result['rows'])
  assert list(tmp_path.glob('tree_attention_*.json')) and list(tmp_path.glob('*.md'))


def test_generate_data_binary_runs_and_resumes(tmp_path):
  config = draft_tiny.get_config('runlocal')
  paths = generate_data.run(config, str(tmp_path))
  assert len(paths) == 1 and paths[0].exists()
  stamp = os.stat(paths[0]).st_mtime_ns  # the shard paths are etils.epath paths
  assert os.stat(generate_data.run(config, str(tmp_path))[0]).st_mtime_ns == stamp


def test_build_features_binary_splits_the_cache_between_workers(tmp_path):
  from experiments.tasks import build_features

  config = draft_tiny.get_config('runlocal')
  config.data.update(dir=str(tmp_path / 'data'), shard_size=16)
  assert len(generate_data.run(config, str(tmp_path))) == 2
  config.data.features_dir = str(tmp_path / 'cache')
  config.data.feature_taps = tuple(config.head.target_layer_ids)
  # Worker 1 of 2 takes the second shard, worker 0 the first; then nothing is left.
  assert build_features.run(config, part=1, parts=2) == 1
  assert len(list((tmp_path / 'cache').rglob('shard_00001.features.npy'))) == 1
  assert build_features.run(config, part=0, parts=2) == 1
  assert build_features.run(config) == 0
  # A data.mix directory with its own cache is built too, split alike.
  config.data.mix = [
    dict(dir=str(tmp_path / 'data'), max_len=64, features_dir=str(tmp_path / 'mix'), weight=0.5)
  ]
  assert build_features.run(config, part=0, parts=2) == 1
  assert len(list((tmp_path / 'mix').rglob('shard_00000.features.npy'))) == 1
  assert build_features.run(config) == 1
  assert build_features.run(config) == 0
  # A mix directory's own matmul mode: its cache is computed (and recorded) in it.
  config.data.mix = [
    dict(
      dir=str(tmp_path / 'data'),
      max_len=64,
      features_dir=str(tmp_path / 'mix_bf16'),
      features_compute_dtype='bfloat16',
      weight=0.5,
    )
  ]
  assert build_features.run(config) == 2
  from jetspec_jax.training import shards as shards_lib

  assert shards_lib.feature_compute_dtype(tmp_path / 'mix_bf16') == 'bfloat16'
  assert shards_lib.feature_compute_dtype(tmp_path / 'cache') == 'float32'
  argv = ['build_features.py', '--config=c.py', '--workers=2']
  assert build_features.worker_command(argv, 1)[-3:] == [*argv[1:], '--part=1']


def test_train_target_binary_on_tiny_config(tmp_path):
  from jetspec_jax.training import target_trainer

  config = target_code_small.get_config('tiny')
  result = target_trainer.train_target(config, str(tmp_path))
  assert result['steps'] == 6 and np.isfinite(result['val_loss'])
  target = js.load_target(tmp_path / 'export')
  assert target.cfg.vocab_size == 300
  # Resume: a second call finds the final checkpoint and does no more steps.
  assert target_trainer.train_target(config, str(tmp_path))['steps'] == 6
  lines = (tmp_path / 'metrics.jsonl').read_text().splitlines()
  assert [json.loads(x)['step'] for x in lines] == [3, 6]


def test_qwen3_8b_recipe_config():
  config = draft_qwen3_8b.get_config()
  assert tuple(config.head.target_layer_ids) == (1, 9, 17, 25, 33)
  assert config.head.block_size == 16 and config.head.num_layers == 5
  assert config.train.num_anchors == 512 and config.train.lr == 3e-4
  assert config.train.loss == 'fkl'


def test_smollm2_benchmark_config_runs_copy_candidates_at_t0_only():
  """The README's SmolLM2 benchmark: best_first trees of 8 and 16 nodes with and without 4 copy
  candidates at T=0, the heads alone at T=1, and batch settings it measures at T=0."""
  from experiments.configs.benchmark import smollm2 as benchmark_smollm2

  config = benchmark_smollm2.get_config()
  kinds = {'jetspec': 'jetspec', 'dflash': 'dflash'}
  greedy = [s.name for s in decode_benchmark.config_settings(config, kinds, temperature=0.0)]
  sampled = [s.name for s in decode_benchmark.config_settings(config, kinds, temperature=1.0)]
  assert greedy[0] == sampled[0] == 'ar'
  assert {
    'tree/jetspec/best_first/8/copy4',
    'chain/dflash/copy4',
    'tree/dflash/best_first/16',
  } < set(greedy)
  assert not [n for n in sampled if 'copy' in n] and 'tree/jetspec/best_first/16' in sampled
  assert set(config.batch_settings) <= set(greedy)
  sweep = benchmark_smollm2.get_config('sweep')
  assert len(decode_benchmark.config_settings(sweep, kinds, temperature=0.0)) == 1 + 2 * (1 + 5 * 2)


def test_public_prompt_groups_are_the_public_sets_in_the_chat_template():
  """The ``public`` benchmark preset decodes seeded prompts of the public sets (docs/results.md),
  each in the target's chat template: the same ids the public table's responses start from."""
  from experiments.configs.benchmark import smollm2 as benchmark_smollm2
  from jetspec_jax.evaluation import prompt_sets, responses

  config = benchmark_smollm2.get_config('public')
  config.public_sets = ('humaneval', 'mtbench')
  config.num_per_group = 2
  try:
    tok = js.load_tokenizer(js.model_cache.smollm2_135m_instruct_path())
  except FileNotFoundError as e:
    pytest.skip(str(e))
  groups = decode_benchmark.load_prompt_groups(config, tok)
  assert list(groups) == ['humaneval', 'mtbench'] and all(len(g) == 2 for g in groups.values())
  drawn = prompt_sets.sample(prompt_sets.load('mtbench'), 2, config.seed)
  assert [list(ids) for ids in groups['mtbench']] == [
    list(responses.prompt_ids(tok, p)) for p in drawn
  ]
  assert tok.decode(groups['humaneval'][0]).count('def ') >= 1


@pytest.mark.parametrize(
  'arg',
  [
    None,
    'sweep',
    'dspark',
    'jetspecpp',
    'copy',
    'groups',
    'long',
    'best_first',
    'best_first_budgets',
    'compare',
    'quick',
    'public',
  ],
)
def test_smollm2_benchmark_configs_name_settings_they_run(arg):
  """Every batch and round-cost setting a SmolLM2 benchmark config names is one of its runs."""
  from experiments.configs.benchmark import smollm2 as benchmark_smollm2

  config = benchmark_smollm2.get_config(arg)
  known = ('jetspec', 'dflash', 'dspark', 'jetspecpp')
  kinds = {name: name if name in known else 'jetspec' for name in config.heads}
  greedy = {s.name for s in decode_benchmark.config_settings(config, kinds, temperature=0.0)}
  assert set(config.get('batch_settings', ())) <= greedy
  assert set(config.get('round_cost_settings') or ()) <= greedy


@pytest.mark.parametrize('name', ['jetspec', 'dflash'])
def test_code_small_head_configs(name):
  from experiments.configs.train import draft_code_small

  config = draft_code_small.get_config(name)
  assert config.head.causal == (name == 'jetspec')
  assert set(config.data.validation_modules) == set(
    target_code_small.get_config().validation_modules
  )


def test_accelerator_benchmark_runs_on_tiny_config(tmp_path):
  from experiments.configs.microbench import accel
  from experiments.tasks import round_costs

  result = round_costs.run(accel.get_config('tiny'), str(tmp_path))
  parts = {r['part'] for r in result['rows']}
  assert parts == {'ar_decode_step', 'verify', 'draft_head', 'tree_accept_commit', 'full_round'}
  assert {r['attn_impl'] for r in result['rows'] if r['part'] == 'verify'} == {'xla', 'pallas'}
  assert result['weight_read_limit_ms'] > 0 and all(r['ms'] > 0 for r in result['rows'])
  rounds = [r for r in result['rows'] if r['part'] == 'full_round']
  assert all(r['tokens_per_round'] == 4 for r in rounds)
  assert list(tmp_path.glob('accel_tiny_*.json'))


def test_one_binary_per_verb_each_dispatching_to_tasks():
  """experiments/ holds the verb binaries only; each names task modules that exist and define
  their flags and a main; the index lists every verb."""
  from experiments.tasks import verb

  root = pathlib.Path(__file__).parent.parent / 'experiments'
  binaries = sorted(p.stem for p in root.glob('*.py') if p.stem != '__init__')
  assert binaries == ['benchmark', 'data', 'demo', 'evaluate', 'microbench', 'train']
  index = (root / 'README.md').read_text()
  for name in binaries:
    source = (root / f'{name}.py').read_text()
    assert 'verb.run(TASKS' in source and f'experiments.{name}' in index
  for name in binaries:
    module = importlib.import_module(f'experiments.{name}')
    for path in module.TASKS.values():
      task_module = importlib.import_module(path)
      assert callable(task_module.define_flags) and callable(task_module.main), path
  assert verb.pop_task(['x', '--task=kernel', '--config=c'], {'kernel': 'm'}, 'a') == (
    'kernel',
    ['x', '--config=c'],
  )
  assert verb.pop_task(['x', '--task', 'b', '-v'], {'a': 'm', 'b': 'n'}, 'a') == ('b', ['x', '-v'])
  with pytest.raises(SystemExit, match='not one of'):
    verb.pop_task(['x', '--task=nope'], {'a': 'm'}, 'a')


def test_verb_binaries_keep_compiled_programs_in_the_compile_cache(tmp_path):
  """data, train and evaluate set a persistent compilation cache (``--compile_cache``, '': none);
  a compiled program lands there, and the timing binaries do not take the flag."""
  import subprocess
  import sys

  (tmp_path / 'cache_probe.py').write_text(
    'import jax, jax.numpy as jnp\n'
    'def define_flags():\n  pass\n'
    'def main(argv):\n'
    '  print("cache:", jax.config.jax_compilation_cache_dir)\n'
    '  jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()\n'
  )
  root = pathlib.Path(__file__).parent.parent
  env = dict(os.environ, PYTHONPATH=f'{tmp_path}{os.pathsep}{root}')
  env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'  # store even a quick compile
  code = (
    'import sys; from experiments.tasks import verb; '
    'verb.run({"probe": "cache_probe"}, "probe", compile_cache=%s)'
  )

  def probe(with_cache: bool, *args: str) -> str:
    return subprocess.run(
      [sys.executable, '-c', code % with_cache, *args],
      env=env,
      capture_output=True,
      text=True,
      check=True,
    ).stdout

  cache = tmp_path / 'xla'
  assert f'cache: {cache}' in probe(True, f'--compile_cache={cache}')
  assert any(cache.iterdir())  # the program was stored
  assert probe(True, '--compile_cache=') == probe(False)  # '': the environment's setting kept
  with pytest.raises(subprocess.CalledProcessError):  # no such flag without compile_cache
    probe(False, f'--compile_cache={cache}')
  for name in ('data', 'train', 'evaluate'):
    assert 'compile_cache=True' in (root / 'experiments' / f'{name}.py').read_text()
