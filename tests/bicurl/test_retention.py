"""Round artifacts are pruned to the last N rounds; the promoted policy and SFT always stay."""

from bat_jax.bicurl.loop import prune_rounds
from bat_jax.bicurl.state import OuterState, RoundRecord, RunPaths
from bat_jax.stagebank.shards import round_dirname


def _round(r: int, promoted: bool) -> RoundRecord:
  return RoundRecord(round=r, target="S1", weights={}, start_policy="sft",
                     candidate=round_dirname(r), gate={}, promoted=promoted, steps=[],
                     healthy=True)


def test_prune_keeps_last_n_rounds_and_the_promoted_policy(tmp_path):
  paths = RunPaths(tmp_path)
  for name in ["sft"] + [round_dirname(r) for r in range(5)]:
    paths.policy(name).mkdir(parents=True)
  for r in range(5):
    (paths.round_checkpoints(r) / "5").mkdir(parents=True)
  # Round 1 was promoted and is still the baseline; rounds 2..4 were held.
  state = OuterState(sft_done=True, baseline=round_dirname(1),
                     rounds=[_round(r, promoted=r == 1) for r in range(5)])
  assert prune_rounds(paths, state, keep=2) == [0, 1, 2]
  kept_ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
  assert kept_ckpts == ["round_000003", "round_000004"]
  kept_policies = sorted(p.name for p in (tmp_path / "policies").iterdir())
  assert kept_policies == ["round_000001", "round_000003", "round_000004", "sft"]
  assert prune_rounds(paths, state, keep=2) == [0, 1, 2]  # idempotent on a resumed run
