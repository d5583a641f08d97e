"""Target-LM trainer: a small Qwen3-architecture code model from scratch (the embedded default,
docs/design.md §7), on the same host loop as the draft-head trainer.

Corpus: the Python standard library sources of the running interpreter (a real code corpus every
Python install carries), minus tests, split by module into train and validation. Tokenizer: a
byte-level BPE trained on the training split with ``tokenizers``. Batches are packed windows of
the token stream; batch ``s`` is a pure function of ``(seed, s)`` so a resumed run continues where
it stopped. Checkpoints: the same Orbax module as head training.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
from absl import logging
from tokenizers import decoders, models, pre_tokenizers, trainers

from jetspec_jax import corpus
from jetspec_jax.models import decoder, hf_io
from jetspec_jax.training.loop import TrainState, init_state, make_optimizer, train_loop

EOS = '<|endoftext|>'
SPECIAL_TOKENS = (EOS, '<|mask|>')


def train_tokenizer(texts: list[str], vocab_size: int, path: pathlib.Path):
  """A byte-level BPE tokenizer (``tokenizer.json``) with ``<|endoftext|>`` and ``<|mask|>``."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  path.parent.mkdir(parents=True, exist_ok=True)
  tok.save(str(path))
  return tok


def encode_corpus(tok, texts: list[str]) -> np.ndarray:
  """All texts, tokenized and joined with EOS, as one ``int32`` stream."""
  eos = tok.token_to_id(EOS)
  out = []
  for enc in tok.encode_batch(texts):
    out.append(np.asarray(enc.ids, np.int32))
    out.append(np.array([eos], np.int32))
  return np.concatenate(out)


def batch_at(stream: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
  """``int32[batch, seq_len + 1]`` random windows of the stream; a pure function of the step."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
  return np.stack([stream[s : s + seq_len + 1] for s in starts])


def lm_loss(params, cfg: decoder.DecoderConfig, windows):
  """Mean next-token cross-entropy (float32) over ``windows[:, :-1] -> windows[:, 1:]``."""
  inputs, labels = windows[:, :-1], windows[:, 1:]
  target = decoder.Target(cfg=cfg, params=params)
  out = target.forward(inputs, target.make_cache(*inputs.shape))
  logits = target.lm_logits(out.hidden).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


_lm_loss_jit = jax.jit(lm_loss, static_argnums=1)


def make_lm_step(cfg: decoder.DecoderConfig, optimizer):
  @jax.jit
  def step(state: TrainState, windows):
    loss, grads = jax.value_and_grad(lm_loss)(state.params, cfg, windows)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(loss=loss, grad_norm=optax.global_norm(grads))
    return TrainState(state.step + 1, params, opt_state), metrics

  return step


def evaluate(params, cfg, stream: np.ndarray, *, batch: int, seq_len: int, num_batches: int):
  """Mean validation loss over fixed windows."""
  losses = [
    float(_lm_loss_jit(params, cfg, batch_at(stream, i, batch, seq_len, seed=12345)))
    for i in range(num_batches)
  ]
  return float(np.mean(losses))


def train_target(config, workdir: str) -> dict:
  """Tokenizer + target training with checkpoints; exports the HF layout to ``config.export_dir``.

  Resumes from the latest checkpoint in ``workdir``. Returns final metrics.
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  train_files, val_files = corpus.stdlib_files(tuple(config.validation_modules))
  train_texts, val_texts = corpus.read_texts(train_files), corpus.read_texts(val_files)
  tok_path = workdir / 'tokenizer.json'
  if tok_path.exists():
    tok = tokenizers.Tokenizer.from_file(str(tok_path))
  else:
    tok = train_tokenizer(train_texts, config.vocab_size, tok_path)
  train_stream = encode_corpus(tok, train_texts)
  val_stream = encode_corpus(tok, val_texts)
  logging.info(
    'corpus: %d train files, %d tokens; %d validation files, %d tokens',
    len(train_files),
    len(train_stream),
    len(val_files),
    len(val_stream),
  )
  cfg = decoder.DecoderConfig(
    **config.model.to_dict(), vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id(EOS)
  )
  optimizer = make_optimizer(
    lr=config.lr,
    steps=config.steps,
    warmup_steps=config.warmup_steps,
    weight_decay=config.weight_decay,
    grad_clip=1.0,
    final_lr_ratio=0.1,
  )
  step_fn = make_lm_step(cfg, optimizer)

  def val_loss_of(params):
    return evaluate(
      params,
      cfg,
      val_stream,
      batch=config.batch,
      seq_len=config.seq_len,
      num_batches=config.eval_batches,
    )

  state, _ = train_loop(
    lambda state, windows, step: step_fn(state, windows),
    init_state(decoder.init_params(cfg, jax.random.key(config.seed)), optimizer),
    lambda step: batch_at(train_stream, step, config.batch, config.seq_len, config.seed),
    workdir,
    steps=config.steps,
    log_every=config.log_every,
    checkpoint_every=config.checkpoint_every,
    tokens_of=lambda windows: windows.shape[0] * (windows.shape[1] - 1),
    evaluate=lambda params: dict(val_loss=val_loss_of(params)),
    eval_every=config.eval_every,
    max_to_keep=2,
  )
  val_loss = val_loss_of(state.params)
  target = decoder.Target(cfg=cfg, params=state.params)
  export = pathlib.Path(config.export_dir or workdir / 'export')
  hf_io.save_target(target, export)
  tok.save(str(export / 'tokenizer.json'))
  result = dict(
    steps=int(state.step),
    val_loss=val_loss,
    train_tokens=len(train_stream),
    val_tokens=len(val_stream),
    params=decoder.count_params(state.params),
    export_dir=str(export),
  )
  (workdir / 'result.json').write_text(json.dumps(result, indent=2))
  return result
