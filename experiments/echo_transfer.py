"""Does a base's copying carry past the rows it was trained on? The echo phases, phase by phase.

Trains the tiny base's echo rows (`<|echo_list|>` pieces `<|echo_copy|>` the same pieces, the
loss on the second copy; `bat_jax.pretrain.base`) through the real trainer (`run_sft`), one
phase per `--phases` entry, and after each phase scores the masked copy NLL and greedy accuracy
on fresh rows it was not trained on:

  short@64       lists of 4-13 in 64-token rows (the default's echo_long phase)
  long@96        one list of 12-40 per row (longer lists, nothing else in the row)
  packed@256     lists of 12-40 packed into 256-token rows (earlier lists in the row)
  deep@1024      one list after ~1,000 tokens of other lists drawn from the other half of the
                 pool (positions a task's episode reaches, no piece in common)
  deep_shared    the same with the earlier lists drawn from the whole pool (shared pieces)
  pairs@256      key/value pairs, then the same pairs shuffled, the loss on the values
                 (associative recall: no fixed offset copies it; `pair_echo_document`)

A phase spec `BxT:lo-hi:steps:pairs` trains on such pair echoes instead of plain ones.

A head that copies by content (an induction head) scores on all five; one that copies by
offset scores only where it was trained (experiments/README.md, "DeltaNet first").

  PYTHONPATH=. python experiments/echo_transfer.py --tokenizer=runs/tiny/tokenizer \
      --layers L,F,F,F --phases 64x32:2-7:100,32x64:4-14:150
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TYPES = {"F": "full_attention", "L": "linear_attention"}


def parse_phase(spec: str) -> tuple[int, int, int, int, int, bool]:
  """`BxT:lo-hi:steps[:pairs]` -> `(batch, seq, lo, hi, steps, pairs)`: lists of lo..hi-1
  pieces; `pairs`: associative-recall echoes (the pairs come back shuffled)."""
  shape, lengths, steps, *kind = spec.split(":")
  if kind not in ([], ["pairs"]):
    raise ValueError(f"phase {spec!r}: the fourth field may only be `pairs`")
  batch, seq = shape.split("x")
  lo, hi = lengths.split("-")
  return int(batch), int(seq), int(lo), int(hi), int(steps), bool(kind)


def pair_echo_document(pieces: list[int], order: list[int], head: int, mid: int, eot: int
                       ) -> tuple[list[int], list[int]]:
  """`(ids, loss mask)`: `head` key/value pairs (`pieces` two by two) `mid` the same pairs in
  `order` `eot`, the loss on the second half's values only. The pairs come back shuffled, so no
  fixed look-back offset predicts a value: only finding the key earlier in the row and copying
  what followed it (an induction head) does."""
  pairs = [pieces[i:i + 2] for i in range(0, len(pieces) - 1, 2)]
  if sorted(order) != list(range(len(pairs))):
    raise ValueError(f"pair echo order {order} is not a permutation of {len(pairs)} pairs")
  ids = ([head] + [t for p in pairs for t in p] + [mid] + [t for i in order for t in pairs[i]]
         + [eot])
  return ids, [0] * (2 * len(pairs) + 2) + [0, 1] * len(pairs) + [0]


class Echoes:
  """Echo documents over `pool` in the base's own format: `head` pieces `mid` pieces `eot`."""

  def __init__(self, head: int, mid: int, eot: int, pool: np.ndarray):
    self.head, self.mid, self.eot, self.pool = head, mid, eot, np.asarray(pool)

  @classmethod
  def from_tokenizer(cls, tokenizer) -> "Echoes":
    """The tiny base's separators, <eot> and echo pool (`bat_jax.pretrain.base`)."""
    from bat_jax.model import tokenizer as tokenizer_lib
    from bat_jax.pretrain import base
    return cls(*base._separators(tokenizer),
               tokenizer.convert_tokens_to_ids(tokenizer_lib.ENDOFTEXT), base._echo_pool(tokenizer))

  def doc(self, rng, lo: int, hi: int, pool, pairs: bool = False
          ) -> tuple[list[int], list[int]]:
    from bat_jax.pretrain import base
    pieces = rng.choice(pool, size=int(rng.integers(lo, hi)), replace=False).tolist()
    if pairs:
      return pair_echo_document(pieces, rng.permutation(len(pieces) // 2).tolist(),
                                self.head, self.mid, self.eot)
    return base.echo_document(pieces, self.head, self.mid, self.eot)

  def rows(self, n: int, seq: int, lo: int, hi: int, seed: int, pairs: bool = False):
    rng = np.random.default_rng(seed)
    from bat_jax.pretrain import base
    docs = iter(lambda: self.doc(rng, lo, hi, self.pool, pairs), None)
    return base._pack(docs, n, seq, self.eot)

  def deep_rows(self, n: int, seq: int, lo: int, hi: int, seed: int, shared: bool):
    """One scored list last in each row, after unscored lists (from the other half of the pool
    unless `shared`)."""
    rng = np.random.default_rng(seed)
    own, other = self.pool[0::2], (self.pool if shared else self.pool[1::2])
    out = []
    for _ in range(n):
      last_ids, last_mask = self.doc(rng, lo, hi, own)
      ids: list[int] = []
      while True:
        filler, _ = self.doc(rng, lo, hi, other)
        if len(ids) + len(filler) + len(last_ids) > seq:
          break
        ids += filler
      pad = seq - len(ids) - len(last_ids)
      out.append((ids + last_ids + [self.eot] * pad,
                  [0] * len(ids) + last_mask + [0] * pad))
    return out


def score(model, rows) -> tuple[float, float]:
  """Masked NLL and greedy accuracy of `rows`' scored tokens."""
  import jax
  import jax.numpy as jnp
  ids = jnp.asarray([r[0] for r in rows])                                  # [N, T]
  mask = np.asarray([r[1] for r in rows], np.float32)[:, 1:]             # [N, T-1]
  logp = jax.nn.log_softmax(jax.jit(lambda t: model(t))(ids).astype(jnp.float32), -1)[:, :-1]
  nll = -np.asarray(jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0])
  hit = np.asarray(jnp.argmax(logp, -1) == ids[:, 1:])
  return float((nll * mask).sum() / mask.sum()), float((hit * mask).sum() / mask.sum())


def evaluate(model, echoes: Echoes) -> dict[str, tuple[float, float]]:
  return {"short@64": score(model, echoes.rows(16, 64, 4, 14, 77)),
          "long@96": score(model, echoes.rows(16, 96, 12, 41, 78)),
          "packed@256": score(model, echoes.rows(16, 256, 12, 41, 79)),
          "deep@1024": score(model, echoes.deep_rows(8, 1024, 12, 41, 80, shared=False)),
          "deep_shared@1024": score(model, echoes.deep_rows(8, 1024, 12, 41, 81, shared=True)),
          "pairs@256": score(model, echoes.rows(16, 256, 12, 41, 82, pairs=True))}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokenizer", required=True, help="a run's tokenizer/ (trained with the "
                 "base's reserved separators: any tiny-base run's)")
  p.add_argument("--layers", default="L,F,F,F", help="layer order: F attention, L DeltaNet")
  p.add_argument("--phases", default="64x32:2-7:100,32x64:4-14:150",
                 help="BxT:lo-hi:steps per phase (the default's two echo phases)")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--every", type=int, default=25)
  args = p.parse_args()

  from flax import nnx

  from bat_jax.bicurl import loop
  from bat_jax.bicurl.grpo_round import run_mesh
  from bat_jax.model import tokenizer as tokenizer_lib
  from bat_jax.run_config import RunConfig
  from bat_jax.sft import SftConfig, run_sft
  from bat_jax.train.step import OptimizerConfig
  from configs import tiny

  cfg = tiny.get_config()
  cfg.unlock()
  cfg.model.hf_config.layer_types = tuple(TYPES[t] for t in args.layers.split(","))
  cfg.model.hf_config.num_hidden_layers = len(cfg.model.hf_config.layer_types)
  run_cfg = RunConfig.from_config(cfg)
  echoes = Echoes.from_tokenizer(tokenizer_lib.load_tokenizer(args.tokenizer))
  build = loop._scratch_builder(run_cfg, args.seed)
  model = nnx.eval_shape(build)
  make_params = lambda trainer: trainer.init_params(build)
  start = time.perf_counter()
  for i, spec in enumerate(args.phases.split(",")):
    batch, seq, lo, hi, steps, pairs = parse_phase(spec)
    losses: list[float] = []

    def on_step(step, metrics, i=i):
      losses.append(float(metrics["loss"]))
      if len(losses) % args.every == 0:
        print(f"phase {i} step {len(losses)}: loss {np.mean(losses[-args.every:]):.3f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)

    sft_cfg = SftConfig(num_steps=steps, batch_size=batch, max_len=seq, seed=args.seed,
                        checkpoint_every=steps, pad_id=echoes.eot,
                        optimizer=OptimizerConfig(learning_rate=args.lr, schedule="constant",
                                                  warmup_steps=args.warmup, total_steps=steps))
    with tempfile.TemporaryDirectory() as checkpoints:   # a phase's end state, then gone
      run_sft(model, echoes.rows(steps * batch, seq, lo, hi, 1000 + i + 100 * args.seed, pairs),
              sft_cfg, checkpoints, mesh=run_mesh(run_cfg),
              rules=tuple(cfg.sharding.rules), make_params=make_params, on_step=on_step)
    make_params = None
    print(f"after phase {i} ({spec}), NLL / greedy accuracy: " + "  ".join(
        f"{k} {nll:.2f} / {acc:.2f}" for k, (nll, acc) in evaluate(model, echoes).items()),
        flush=True)


if __name__ == "__main__":
  main()
