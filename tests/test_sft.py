"""Cold-start SFT: target-only mask, masked NLL, input errors, SIGKILL -> resume bit-identity."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bat_jax.model import chat_format
from bat_jax.model import tokenizer_corpus
from bat_jax.model import tokenizer as tk
from bat_jax.sft import (SftBatches, SftConfig, balanced_repeats, drop_too_long, length_groups,
                         pad_example, sft_dataset, sft_loss_fn)

FIXTURES = Path(__file__).parent / "grpo"
sys.path.insert(0, str(FIXTURES))
from policy_fixtures import tiny_model  # noqa: E402


def _action(code: str, thought: str) -> dict:
  return {"name": "execute_code", "arguments": {"language": "python", "code": code},
          "thought": thought}


def test_sft_mask_covers_only_the_target_action(tmp_path):
  tok_dir = tk.train_tokenizer(tokenizer_corpus.tiny_corpus(60), 400, tmp_path / "tok")
  tok = tk.load_tokenizer(tok_dir)
  fmt = chat_format.ChatFormat.for_model("qwen3", tok)
  earlier = _action("print(1)", "look first")
  target = _action("print(sorted(__import__('os').listdir('.')))", "list the workspace")
  messages = [{"role": "system", "content": "Work through the staged task."},
              {"role": "user", "content": "Prepare the environment."},
              {"role": "assistant", "action": earlier},
              {"role": "tool", "content": "exit_code=0\nstdout:1\nstderr:"}]
  ids, mask = fmt.encode_sft_example(messages, target)
  ids, mask = np.asarray(ids), np.asarray(mask)
  # Exactly the target turn (its end token included) carries loss; the earlier action does not.
  np.testing.assert_array_equal(ids[mask == 1], fmt.encode_action(target))
  assert mask[-1] == 1 and mask.sum() == len(fmt.encode_action(target))
  assert fmt.decode(ids[mask == 1]).startswith(fmt.decode(fmt.encode(fmt.render_action(target))))
  padded = pad_example(ids, mask, max_len=len(ids) + 7, pad_id=fmt.endoftext_id)
  assert padded["loss_mask"][len(ids):].sum() == 0 and padded["loss_mask"].sum() == mask.sum()

  # The SFT loss is the NLL of exactly those tokens, and padding content cannot change it.
  model = tiny_model(vocab_size=len(tok))
  batch = {k: jnp.asarray(v)[None] for k, v in padded.items()}
  loss_fn = jax.jit(lambda b: sft_loss_fn(chunk_size=8)(model, b, None))
  num, den, _ = loss_fn(batch)
  logits = jax.jit(lambda x: model(x))(batch["input_ids"])[0]
  logp = jax.nn.log_softmax(logits[:-1], -1)[np.arange(len(ids) + 6), padded["input_ids"][1:]]
  want = -np.asarray(logp)[padded["loss_mask"][1:] == 1].sum()
  np.testing.assert_allclose(float(num), want, rtol=1e-5)
  assert float(den) == mask.sum()
  repadded = {**batch, "input_ids": batch["input_ids"].at[0, len(ids):].set(5)}
  assert float(loss_fn(repadded)[0]) == float(num)
  # With a context weight w, every other real token after the first adds w * its NLL.
  with_context = jax.jit(lambda b: sft_loss_fn(chunk_size=8, context_weight=0.5)(model, b, None))
  num_c, den_c, metrics = with_context(batch)
  context = (padded["valid"][1:] == 1) & (padded["loss_mask"][1:] == 0)
  want_context = -np.asarray(logp)[context].sum()
  np.testing.assert_allclose(float(num_c), want + 0.5 * want_context, rtol=1e-5)
  assert float(den_c) == mask.sum() + 0.5 * context.sum()
  assert float(metrics["nll_sum"]) == float(num) and float(metrics["tokens"]) == mask.sum()
  assert float(with_context(repadded)[0]) == float(num_c)   # padding still carries nothing
  with pytest.raises(ValueError, match="context_weight must be >= 0"):
    sft_loss_fn(context_weight=-1.0)


def _ragged_batch(vocab: int, rng: np.random.Generator) -> dict:
  """[4, 40]: rows of different lengths, targets in several runs per row (as packed base rows)."""
  rows = []
  for length, spans in ((40, ((5, 9), (20, 31))), (23, ((18, 23),)), (31, ((2, 4), (29, 31))),
                        (12, ((11, 12),))):
    mask = np.zeros(length, np.int32)
    for a, b in spans:
      mask[a:b] = 1
    rows.append(pad_example(rng.integers(1, vocab, length), mask, max_len=40, pad_id=0))
  return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


def test_the_head_on_targets_only_gives_the_full_loss_and_gradients():
  """`targets_per_row` computes the head at the target positions only: the same loss, the same
  gradients, as the head at every position; a bound below a row's targets is reported."""
  from flax import nnx
  from bat_jax.sft import max_targets_per_row
  model = tiny_model(vocab_size=96)
  batch = _ragged_batch(96, np.random.default_rng(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def value_and_grad(loss_fn):
    def f(p):
      num, den, metrics = loss_fn(nnx.merge(graphdef, p, rest), batch, None)
      return num / den, metrics
    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

  (full, _), full_grads = value_and_grad(sft_loss_fn(chunk_size=8))
  (sel, metrics), sel_grads = value_and_grad(sft_loss_fn(chunk_size=8, targets_per_row=16))
  np.testing.assert_allclose(float(sel), float(full), rtol=1e-6)
  assert int(metrics["unscored_targets"]) == 0 and float(metrics["tokens"]) == 15 + 5 + 4 + 1
  for a, b in zip(jax.tree.leaves(full_grads), jax.tree.leaves(sel_grads)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=1e-7)
  # Row 0 has 15 targets: a bound of 8 drops 7 of them, and says so.
  (_, short), _ = value_and_grad(sft_loss_fn(chunk_size=8, targets_per_row=8))
  assert int(short["unscored_targets"]) == 7
  with pytest.raises(ValueError, match="7 target tokens fell past the per-row bound"):
    SftBatches(iter(())).record(3, {"loss": 1.0, "unscored_targets": np.int32(7)})
  examples = [(list(range(9)), [0, 1, 1, 0, 0, 0, 0, 0, 1]), (list(range(40)), [0] * 19 + [1] * 21)]
  assert max_targets_per_row(examples) == 32 and max_targets_per_row(examples, 1) == 21


def test_bad_examples_name_the_problem():
  with pytest.raises(ValueError, match="19 tokens > max_len=16"):
    pad_example(list(range(19)), [0] * 18 + [1], max_len=16, pad_id=0)
  with pytest.raises(ValueError, match="loss_mask\\[0\\] is 1"):
    pad_example([1, 2, 3], [1, 1, 1], max_len=4, pad_id=0)
  with pytest.raises(ValueError, match="must be equal 1-D"):
    pad_example([1, 2, 3], [0, 1], max_len=4, pad_id=0)
  with pytest.raises(ValueError, match="SFT example 1 has an all-zero loss_mask"):
    sft_dataset([([1, 2], [0, 1]), ([1, 2], [0, 0])], batch_size=1, max_len=4, seed=0)
  kept, dropped = drop_too_long([([1] * 3, [0, 0, 1]), ([1] * 9, [0] * 8 + [1])], max_len=4)
  assert len(kept) == 1 and dropped == [1]
  with pytest.raises(ValueError, match="SftConfig.batch_size must be >= 1"):
    SftConfig(num_steps=1, batch_size=0, max_len=4)


def test_length_groups_put_each_row_in_the_shortest_bucket_that_fills_a_batch():
  lengths = [3, 4, 5, 9, 10, 10, 15, 16]
  # 8: [0,1,2], 12: [3,4,5], 16: [6,7]; batch 2: every bucket fills a batch.
  assert length_groups(lengths, (8, 12), 16, 2) == [(8, [0, 1, 2]), (12, [3, 4, 5]),
                                                      (16, [6, 7])]
  # batch 3: the 16 bucket (2 rows) joins the one before it, padded to 16.
  assert length_groups(lengths, (8, 12), 16, 3) == [(8, [0, 1, 2]), (16, [3, 4, 5, 6, 7])]
  # batch 4: the 8 bucket (3 rows) joins the 12 one, the 16 one (2 rows) joins that: one
  # group; buckets >= max_len are ignored.
  assert length_groups(lengths, (8, 12, 16, 32), 16, 4) == [(16, list(range(8)))]
  assert length_groups(lengths, (8, 12), 16, 3)[0] == (8, [0, 1, 2])
  assert length_groups(lengths, (), 16, 4) == [(16, list(range(8)))]
  with pytest.raises(ValueError, match="SFT example 1 has 20 tokens > max_len=16"):
    length_groups([3, 20], (8,), 16, 1)


def test_bucketed_batches_pad_each_row_to_its_bucket_and_cover_every_row():
  lengths = [3, 4, 5, 6, 11, 12, 13, 14]
  examples = [([i + 1] * n, [0] * (n - 1) + [1]) for i, n in enumerate(lengths)]
  batches = list(sft_dataset(examples, batch_size=2, max_len=16, seed=0,
                             bucket_lengths=(8,))[:8])
  assert {b["input_ids"].shape for b in batches} == {(2, 8), (2, 16)}
  seen = [int(row[0]) for b in batches for row in b["input_ids"]]
  assert sorted(seen) == sorted(2 * list(range(1, 9)))    # two epochs, every row twice
  for b in batches:
    short = b["input_ids"].shape[1] == 8
    assert all((int(r[0]) <= 4) == short for r in b["input_ids"])  # rows 1-4 are <= 8 tokens
    np.testing.assert_array_equal(b["valid"].sum(1), [len(examples[int(r[0]) - 1][0])
                                                      for r in b["input_ids"]])


NUM_STEPS = 8
_DRIVER = textwrap.dedent("""
    import sys, time
    import numpy as np, jax
    sys.path.insert(0, {fixtures!r})
    from policy_fixtures import sft_examples, tiny_model
    from bat_jax.train import OptimizerConfig
    from bat_jax.sft import SftConfig, run_sft
    cfg = SftConfig(num_steps={steps}, batch_size=4, max_len=16, bucket_lengths=(12,),
                    checkpoint_every=2,
                    keep_checkpoints=2, logprob_chunk_size=8,
                    optimizer=OptimizerConfig(learning_rate=1e-2, schedule="cosine",
                                              warmup_steps=2, total_steps={steps}))
    delay = float(sys.argv[2])
    def on_step(step, metrics):
      print("step", step, float(metrics["loss"]), flush=True)
      time.sleep(delay)
    state = run_sft(tiny_model(), sft_examples(), cfg, sys.argv[1], on_step=on_step)
    np.savez(sys.argv[3], *[np.asarray(x) for x in jax.tree.leaves(state)])
    print("done", flush=True)
""")


def _start_driver(tmp_path: Path, run: str, delay: float) -> tuple[subprocess.Popen, Path]:
  script = tmp_path / f"{run}.py"
  script.write_text(_DRIVER.format(fixtures=str(FIXTURES), steps=NUM_STEPS))
  out = tmp_path / f"{run}.npz"
  # One persistent XLA cache for the three drivers: the first compiles, the others load.
  env = {**os.environ, "PYTHONPATH": os.getcwd(),
         "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / run), str(delay), str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  return proc, out


def _follow(proc: subprocess.Popen, kill_after_step: int | None = None) -> list[int]:
  """Steps the driver reports; SIGKILLs it once it reports `kill_after_step`."""
  steps = []
  for line in proc.stdout:
    if line.startswith("step"):
      steps.append(int(line.split()[1]))
      if kill_after_step is not None and steps[-1] >= kill_after_step:
        proc.send_signal(signal.SIGKILL)
        break
  proc.wait(timeout=300)
  if kill_after_step is None:
    assert proc.returncode == 0, proc.stderr.read()
  return steps


def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path):
  # The uninterrupted reference first: it fills the XLA cache the other two load from.
  reference, ref_out = _start_driver(tmp_path, "uninterrupted", 0.0)
  assert _follow(reference) == list(range(1, NUM_STEPS + 1))
  victim, _ = _start_driver(tmp_path, "killed", 0.5)
  steps = _follow(victim, kill_after_step=5)
  assert victim.returncode == -signal.SIGKILL, victim.stderr.read()
  assert steps[-1] < NUM_STEPS
  resumed, out = _start_driver(tmp_path, "killed", 0.0)
  resumed_steps = _follow(resumed)
  assert 1 < resumed_steps[0] <= 6  # picked up from a committed checkpoint, not from scratch
  assert resumed_steps[-1] == NUM_STEPS
  want, got = np.load(ref_out), np.load(out)
  assert len(want.files) == len(got.files) > 4
  for key in want.files:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  # Retention: only the last two steps are kept.
  kept = sorted(int(p.name) for p in (tmp_path / "killed").iterdir() if p.name.isdigit())
  assert kept == [NUM_STEPS - 2, NUM_STEPS]


def test_balanced_repeats_even_out_rare_decisions():
  """A kind of n rows is drawn ~ n ** (1 - exponent): 0 leaves the rows as built, 1 gives
  every kind the share of the most common one; repeats never drop a row."""
  kinds = ["plan"] * 168 + ["fix"] * 14 + ["submit"] * 42
  def shares(exponent):
    totals = {}
    for kind, n in zip(kinds, balanced_repeats(kinds, exponent)):
      totals[kind] = totals.get(kind, 0) + n
    return totals
  assert shares(0.0) == {"plan": 168, "fix": 14, "submit": 42}
  assert shares(1.0) == {"plan": 168, "fix": 168, "submit": 168}
  assert shares(0.5) == {"plan": 168, "fix": 42, "submit": 84}
  assert min(balanced_repeats(["a", "b", "b", "b"], 0.3)) == 1
  assert balanced_repeats([], 1.0) == []
  with pytest.raises(ValueError, match="exponent 1.5"):
    balanced_repeats(kinds, 1.5)
