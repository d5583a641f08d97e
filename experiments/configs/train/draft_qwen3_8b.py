"""The paper's recipe for a Qwen3-8B JetSpec head (docs/draft_head.md §1, docs/training.md §7).

Run (8 chips: tensor parallel over all of them, ``mesh.model``; per-device memory in the
README's table, ``experiments/tasks/memory_plan.py``):
  python -m experiments.data --config=experiments/configs/train/draft_qwen3_8b.py \
      --config.target.path=/ckpt/Qwen3-8B --config.data.prompts=/data/prompts.jsonl \
      --workdir=/runs/jetspec-8b
  python -m experiments.train --config=experiments/configs/train/draft_qwen3_8b.py \
      --config.target.path=/ckpt/Qwen3-8B --config.data.prompts=/data/prompts.jsonl \
      --workdir=/runs/jetspec-8b

Data it expects: ``prompts.jsonl`` with one conversation per line (``{"messages": [...]}`` or
ShareGPT's ``{"conversations": [...]}``; or ``{"prompt_ids": [...]}`` already rendered and
tokenized), put in the target's chat template in non-thinking mode
(``data.chat_template_kwargs``, docs/training.md §7); the paper uses ~800K
prompts (Nemotron-Post-Training-Dataset-v2 code + math + samples of STEM/chat, plus CodeAlpaca).
The target regenerates each response (greedy, up to 4096 tokens total). Head: 5 layers, taps
[1, 9, 17, 25, 33], block 16, MASK id 151669, ~1.05B parameters; 512 anchors per sequence,
forward KL at T=1, no depth decay, AdamW 3e-4 with 4% warmup and cosine decay, clip 1.0, 6 epochs.
Result: not run in this repository (no accelerator budget for it); the tiny config is the tested
path.
"""

import ml_collections

from experiments.configs.train import draft_tiny


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = draft_tiny.get_config()
  config.target = ml_collections.ConfigDict(
    # dtype 'auto': bfloat16 weights on GPU / TPU (16 GB for 8B), float32 on CPU
    dict(path='', preset='', seed=0, param_scale=1.0, overrides={}, dtype='auto')
  )
  config.head = ml_collections.ConfigDict(
    dict(
      num_layers=5,
      block_size=16,
      causal=True,
      target_layer_ids=(1, 9, 17, 25, 33),
      intermediate_size=12288,
      mask_token_id=151669,
    )
  )
  config.data.update(
    prompts='',
    num_prompts=0,
    max_new_tokens=4096 - 512,
    max_len=4096,
    shard_size=1024,
    generate_batch=32,  # the KV cache of 32 x 4096 tokens: 2.4 GiB per device on 8
    temperature=0.0,
    chat_template_kwargs={'enable_thinking': False},
  )
  config.train.update(
    num_anchors=512,
    loss='fkl',
    temperature=1.0,
    gamma=0.0,
    loss_chunk=16,
    global_batch=16,
    # Per-device memory on 8 x 16 GiB (the README's table, experiments/tasks/memory_plan.py): tensor
    # parallel over 8 devices, one sequence at a time, 16 anchors at a time.
    micro_batches=16,
    anchor_chunk=16,
    compute_dtype='bfloat16',
    steps=6 * 800_000 // 16,
    lr=3e-4,
    warmup_steps=int(0.04 * 6 * 800_000 // 16),
    weight_decay=0.0,
    grad_clip=1.0,
    log_every=50,
    checkpoint_every=2000,
  )
  config.mesh.update(model=8)
  config.eval.update(num_prompts=32, max_new_tokens=256)
  config.eval.method = ml_collections.ConfigDict(dict(name='tree', budget=256, width=7))
  return config
