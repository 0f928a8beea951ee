"""BiCuRL outer loop: pieces (batching, state, report) and a short end-to-end run.

The end-to-end run uses `configs/tiny.py:smoke` (`tests/bicurl/fast_config.py`). The
SIGKILL-and-resume check and the launch.py checks live in tests/bicurl/.
"""

import json

import jax
import numpy as np
import pytest

from bat_jax import curriculum, workflow
from bat_jax.bicurl import OuterState, RoundRecord, run
from bat_jax.bicurl.grpo_round import bucket_length, grpo_config, rollout_batch
from bat_jax.bicurl.report import PLOTS, build_report, markdown
from bat_jax.bicurl.setup import sft_states
from bat_jax.rollout import Trajectory
from bat_jax.stagebank import grid
from tests.bicurl.fast_config import fast_config


def _traj(state_id: str, reward: float, n: int = 5) -> Trajectory:
  return Trajectory(state_id=state_id, stage="S1", pool="s_target", task_id="t", sample_index=0,
                    token_ids=list(range(1, n + 1)), loss_mask=[0, 0] + [1] * (n - 2),
                    sampler_logp=[0.0] * n, prompt_len=2, reward=reward,
                    finish_reason="agent_stop")


def test_bucket_length_is_a_power_of_two_within_the_cap():
  assert bucket_length(1, 4096) == 128
  assert bucket_length(129, 4096) == 256
  assert bucket_length(1024, 4096) == 1024
  assert bucket_length(3000, 2048) == 2048


def test_rollout_batch_advantages_stay_within_each_state_id():
  trajs = [_traj("a", 1.0), _traj("b", 0.5), _traj("a", 0.0), _traj("b", 0.5, n=7)]
  batch, stats = rollout_batch(trajs, max_len=512, cfg=grpo_config(fast_config()), pad_id=0)
  # group a: mean 0.5 -> +-0.5; group b: equal rewards -> 0 (never compared with group a)
  np.testing.assert_allclose(batch["advantages"], [0.5, 0.0, -0.5, 0.0])
  assert batch["input_ids"].shape == (4, 128) and batch["loss_mask"][3, :7].sum() == 5
  assert stats["reward_mean"] == pytest.approx(0.5) and stats["length"] == 7


def test_sft_states_cover_tracks_before_repeating():
  states, per_state = sft_states(48)   # two (track, outcome) cells x six foci
  assert per_state == 1 and len(states) == 12
  assert len({s.track for s in states}) == 2
  states, per_state = sft_states(2000)
  assert states == grid.SOURCE_GRID and per_state == 4


def test_outer_state_round_trips_and_reports(tmp_path):
  state = OuterState(sft_done=True, baseline="round_000",
                     next_weights={"pool_mix": {"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25},
                                   "stage_weights": {s: float(s == "S4") for s in workflow.STAGES}})
  scores = {s: 0.1 * i for i, s in enumerate(workflow.STAGES)}
  for name in ("sft", "round_000"):
    state.evaluations[name] = {"overall": 0.3, "task": 0.2, "agentic": 0.4,
                               "stage_scores": scores, "failure_categories": {}}
  state.rounds.append(RoundRecord(
      round=0, target="S1", weights=state.next_weights, start_policy="sft",
      candidate="round_000", gate={"passed": False, "reasons": ["overall_drop: 0.02 > 0.01"],
                                   "checks": {}},
      promoted=False, steps=[{"step": 1, "reward_mean": 0.25, "kl": 0.01}], healthy=True))
  state.phase_seconds["sft"] = 3.0
  state.save(tmp_path)
  loaded = OuterState.load(tmp_path)
  assert loaded == state
  report = build_report(loaded)
  assert [e["policy"] for e in report["evaluations"]] == ["sft", "round_000"]
  assert report["rounds"][0]["reward_mean"] == 0.25 and report["rounds"][0]["kl_mean"] == 0.01
  md = markdown(report)
  assert "| 0 | S1 | S4:1.00 | s_target:0.50 s_mix:0.25 e2e:0.25 | sft | hold | False |" in md
  assert "overall_drop: 0.02 > 0.01" in md


def test_corrupt_outer_state_is_named(tmp_path):
  (tmp_path / "outer_state.json").write_text("{not json")
  with pytest.raises(ValueError, match="outer_state.json is unreadable"):
    OuterState.load(tmp_path)


@pytest.fixture
def compilation_cache(tmp_path):
  """A persistent XLA cache for the test (what launch.py sets per run): the SFT step compiled
  ahead of time for its memory analysis is then not compiled a second time."""
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  saved = {k: getattr(jax.config, k) for k in keys}
  jax.config.update(keys[0], str(tmp_path / "xla_cache"))
  jax.config.update(keys[1], 0.0)
  yield
  for k, v in saved.items():
    jax.config.update(k, v)


def test_end_to_end_tiny_run_artifacts_and_round_structure(tmp_path, require_bwrap,
                                                            compilation_cache):
  cfg = fast_config()
  report = run(cfg, tmp_path / "run")
  tmp_path = tmp_path / "run"
  rounds = cfg.grpo.rounds

  # Artifacts.
  for name in ("report.json", "report.md", "outer_state.json", *PLOTS):
    assert (tmp_path / name).is_file(), name
  assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
  assert json.loads((tmp_path / "report.json").read_text()) == report
  for policy in ["sft"] + [f"round_{r:03d}" for r in range(rounds)]:
    assert (tmp_path / "policies" / policy / "config.json").is_file()
    assert list((tmp_path / "policies" / policy).glob("*.safetensors"))
    assert (tmp_path / "evals" / f"{policy}.json").is_file()
  for r in range(rounds):
    assert (tmp_path / "stagebank" / f"round_{r:06d}" / "manifest.json").is_file()
    assert (tmp_path / "ckpt" / f"round_{r:03d}").is_dir()

  # Round structure: targets from the curriculum, the gate decides the next start.
  state = OuterState.load(tmp_path)
  assert [e["policy"] for e in report["evaluations"]] == \
      ["sft"] + [f"round_{r:03d}" for r in range(rounds)]
  assert len(state.rounds) == rounds
  assert state.rounds[0].target == curriculum.select_target(
      state.evaluations["sft"]["stage_scores"])
  baseline = "sft"
  for r, rec in enumerate(state.rounds):
    assert rec.round == r and rec.start_policy == baseline
    assert [s["step"] for s in rec.steps] == list(range(1, cfg.grpo.steps_per_round + 1))
    assert all(np.isfinite(s["loss"]) and "reward_mean" in s for s in rec.steps)
    assert rec.promoted == rec.gate["passed"] and "training_healthy" in rec.gate["checks"]
    # Tied rewards in every group give no signal: no update (not even a KL-only Adam step).
    for s in rec.steps:
      assert s["no_signal"] in (0.0, 1.0)
      if s["no_signal"]:
        assert s["update_applied"] == 0 and s["grad_norm"] == 0
    if all(s["no_signal"] for s in rec.steps):
      weights = lambda p: sorted(f.read_bytes() for f in (tmp_path / "policies" / p).glob(
          "*.safetensors"))
      assert weights(rec.candidate) == weights(rec.start_policy)
    baseline = rec.candidate if rec.promoted else baseline
  assert state.baseline == baseline == report["baseline"]
  for phase in ("sft", "evaluation", "rollout", "update"):
    assert report["phase_seconds"][phase] > 0, phase

  # Finished: a rerun on the same directory does no work and returns the same report.
  again = run(cfg, tmp_path)
  assert again["evaluations"] == report["evaluations"]


def test_resume_with_another_config_is_refused_naming_the_field(tmp_path):
  from bat_jax.bicurl.loop import _check_same_config
  _check_same_config(fast_config(), tmp_path / "config.json")
  _check_same_config(fast_config(logging__tensorboard=False), tmp_path / "config.json")  # ok
  with pytest.raises(ValueError, match=r"grpo: lr 0.0001 -> 0.5"):
    _check_same_config(fast_config(grpo__lr=0.5), tmp_path / "config.json")
