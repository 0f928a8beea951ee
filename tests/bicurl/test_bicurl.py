"""BiCuRL outer loop: pieces (batching, state, report) and a short end-to-end run.

The end-to-end run uses `configs/tiny.py:smoke` (`tests/bicurl/fast_config.py`); one run is
shared by the end-to-end tests, each checking one concern. The SIGKILL-and-resume check and the
launch.py checks have their own files.
"""

import dataclasses
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from bat_jax import workflow
from bat_jax.stagebank.rounds import RoundWeights
from bat_jax.bicurl import OuterState, RoundRecord, RunPaths, run
from bat_jax.bicurl.grpo_round import bucket_length, grpo_config, rollout_batch
from bat_jax.bicurl.report import PLOTS, build_report, headline, markdown
from bat_jax.bicurl.setup import sft_states
from bat_jax.bicurl.state import STATE_FILE, heldback_name
from bat_jax.rollout import Trajectory
from bat_jax.stagebank import grid, shards
from configs import tiny
from tests.bicurl.fast_config import fast_config


def _traj(state_id: str, reward: float, n: int = 5) -> Trajectory:
  return Trajectory(state_id=state_id, focus="S1", pool="s_target", task_id="t", sample_index=0,
                    token_ids=list(range(1, n + 1)), loss_mask=[0, 0] + [1] * (n - 2),
                    sampler_logp=[0.0] * n, prompt_len=2, reward=reward,
                    finish_reason="agent_stop")


def test_bucket_length_is_a_power_of_two_or_a_half_step_within_the_cap():
  assert bucket_length(1, 4096) == 128
  assert bucket_length(129, 4096) == 192
  assert bucket_length(193, 4096) == 256
  assert bucket_length(1024, 4096) == 1024
  assert bucket_length(1025, 4096) == 1536   # a tiny-config rollout (~1,400 tokens)
  assert bucket_length(1537, 4096) == 2048
  assert bucket_length(3000, 2048) == 2048
  lengths = range(1, 5000)
  # At most 1.5x the longest row (powers of two alone: 2x), and never fewer positions.
  assert all(n <= bucket_length(n, 8192) <= max(128, 1.5 * n) for n in lengths)


def test_rollout_batch_advantages_stay_within_each_state_id():
  trajs = [_traj("a", 1.0), _traj("b", 0.5), _traj("a", 0.0), _traj("b", 0.5, n=7)]
  batch, stats = rollout_batch(trajs, max_len=512, cfg=grpo_config(fast_config()), pad_id=0)
  # group a: mean 0.5 -> +-0.5; group b: equal rewards -> 0 (never compared with group a)
  np.testing.assert_allclose(batch["advantages"], [0.5, 0.0, -0.5, 0.0])
  assert batch["input_ids"].shape == (4, 128) and batch["loss_mask"][3, :7].sum() == 5
  assert stats["reward_mean"] == pytest.approx(0.5) and stats["length"] == 7


def test_rollout_batch_reports_each_pools_reward_and_the_stage_ends():
  trajs = [_traj("a", 1.0), _traj("a", 0.0), _traj("b", 0.5), _traj("b", 0.0)]
  trajs[2].pool = trajs[3].pool = "e2e"
  trajs[1].finish_reason = "stage_end"
  _, stats = rollout_batch(trajs, max_len=512, cfg=grpo_config(fast_config()), pad_id=0)
  assert stats["reward_s_target"] == 0.5 and stats["reward_e2e"] == 0.25
  assert "reward_s_mix" not in stats and stats["stage_ends"] == 1.0


def test_failed_call_penalty_ranks_a_clean_trajectory_above_one_with_stray_failures():
  """Same rubric reward, but one continuation also made a failing call and a malformed turn:
  with `grpo.failed_call_penalty` the clean one gets the positive advantage; without it, none."""
  clean, stray = _traj("a", 1.0), _traj("a", 1.0)
  stray.num_failed_calls, stray.num_malformed = 1, 1
  cfg = grpo_config(fast_config())
  off, _ = rollout_batch([clean, stray], max_len=512, cfg=cfg, pad_id=0)
  on, stats = rollout_batch([clean, stray], max_len=512, cfg=cfg, pad_id=0,
                            failed_call_penalty=0.1)
  np.testing.assert_allclose(off["advantages"], [0.0, 0.0])
  np.testing.assert_allclose(on["advantages"], [0.1, -0.1], rtol=1e-6)
  assert stats["reward_mean"] == 1.0 and stats["failed_turns"] == 1.0  # logged: the rubric's


def test_untrained_stage_stop_masks_only_the_closing_turn_of_stopped_stage_rows():
  """`grpo.train_stage_stop` False: a stage-local row that ended by stopping loses its last run
  of generated tokens (the stop turn) from the loss, and nothing else; an E2E row, or a stage
  row cut by a limit, keeps every generated token."""
  # prompt 2, a call turn of 3, an observation of 2, a stop turn of 2.
  mask = [0, 0, 1, 1, 1, 0, 0, 1, 1]
  def traj(focus, reward, finish="agent_stop"):
    return dataclasses.replace(_traj("a" + focus, reward, n=9), focus=focus, loss_mask=mask,
                               finish_reason=finish)
  trajs = [traj("S3", 1.0), traj("S3", 0.0), traj("E2E", 1.0), traj("E2E", 0.0),
           traj("S4", 1.0, "max_turns"), traj("S4", 0.0, "max_turns")]
  cfg = grpo_config(fast_config())
  kept, _ = rollout_batch(trajs, max_len=512, cfg=cfg, pad_id=0)
  cut, _ = rollout_batch(trajs, max_len=512, cfg=cfg, pad_id=0, train_stage_stop=False)
  np.testing.assert_array_equal(kept["loss_mask"][:, :9], np.tile(mask, (6, 1)))
  np.testing.assert_array_equal(cut["loss_mask"][:2, :9], [[0, 0, 1, 1, 1, 0, 0, 0, 0]] * 2)
  np.testing.assert_array_equal(cut["loss_mask"][2:, :9], np.tile(mask, (4, 1)))
  np.testing.assert_array_equal(cut["advantages"], kept["advantages"])


def test_rows_beside_pretraining_run_niced_and_leave_the_trainer_thread_alone():
  """The cold-start rows are built beside the base's pretraining at nice 10: set on their own
  thread only (Linux nice is per thread) and inherited by what that thread starts."""
  import concurrent.futures
  import threading
  from bat_jax.bicurl import loop
  me = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
  before = me()

  def started_inside():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:   # as the rows' sandbox workers
      return me(), pool.submit(me).result()

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    own, child = pool.submit(loop._niced, started_inside).result()
  assert own == child == min(before + 10, 19) and me() == before


def test_sft_states_cover_tracks_before_repeating():
  states, per_state = sft_states(48)   # two (track, outcome) cells x six foci
  assert per_state == 1 and len(states) == 12
  assert len({s.track for s in states}) == 2
  states, per_state = sft_states(2000)
  assert states == grid.SOURCE_GRID and per_state == 4


def test_outer_state_round_trips_and_reports(tmp_path):
  state = OuterState(sft_done=True, baseline="round_000000",
                     next_weights=RoundWeights.for_target("S4"))
  scores = {s: 0.1 * i for i, s in enumerate(workflow.STAGES)}
  for name in ("sft", "round_000000"):
    state.evaluations[name] = {"overall": 0.3, "task": 0.2, "agentic": 0.4,
                               "stage_scores": scores, "failure_categories": {}}
  state.rounds.append(RoundRecord(
      round=0, target="S1", weights=state.next_weights, start_policy="sft",
      candidate="round_000000", gate={"passed": False, "reasons": ["overall_drop: 0.02 > 0.01"],
                                   "checks": {}},
      promoted=False, steps=[{"step": 1, "reward_mean": 0.25, "kl": 0.01}], healthy=True))
  state.phase_seconds["sft"] = 3.0
  state.save(tmp_path)
  loaded = OuterState.load(tmp_path)
  assert loaded == state
  report = build_report(loaded)
  assert [e["policy"] for e in report["evaluations"]] == ["sft", "round_000000"]
  assert report["rounds"][0]["reward_mean"] == 0.25 and report["rounds"][0]["kl_mean"] == 0.01
  md = markdown(report)
  assert "| 0 | S1 | S4:1.00 | s_target:0.50 s_mix:0.25 e2e:0.25 | sft | - | hold | False |" in md
  assert "overall_drop: 0.02 > 0.01" in md


def test_corrupt_outer_state_is_named(tmp_path):
  (tmp_path / "outer_state.json").write_text("{not json")
  with pytest.raises(ValueError, match="outer_state.json is unreadable"):
    OuterState.load(tmp_path)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """One short end-to-end run, shared by the tests below: (config, run paths, report).

  A persistent XLA cache is set for the run (what launch.py sets per run), so the SFT step
  compiled ahead of time for its memory analysis is not compiled a second time."""
  if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
  tmp = tmp_path_factory.mktemp("bicurl")
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  saved = {k: getattr(jax.config, k) for k in keys}
  jax.config.update(keys[0], str(tmp / "xla_cache"))
  jax.config.update(keys[1], 0.0)
  try:
    cfg = tiny.get_config("smoke,base")  # the tiny base's pretraining phase included
    paths = RunPaths(tmp / "run")
    yield cfg, paths, run(cfg, paths.workdir)
  finally:
    for k, v in saved.items():
      jax.config.update(k, v)


def _policies(cfg) -> list[str]:
  return ["sft"] + [shards.round_dirname(r) for r in range(cfg.grpo.rounds)]


def test_end_to_end_run_writes_every_artifact(finished_run):
  cfg, paths, report = finished_run
  for name in ("report.json", "report.md", STATE_FILE, *PLOTS):
    assert (paths.workdir / name).is_file(), name
  assert list(paths.tensorboard.glob("events.out.tfevents.*"))
  assert json.loads((paths.workdir / "report.json").read_text()) == report
  for policy in _policies(cfg):
    assert (paths.policy(policy) / "config.json").is_file()
    assert list(paths.policy(policy).glob("*.safetensors"))
    assert paths.eval_report(policy).is_file()
  for r in range(cfg.grpo.rounds):
    assert (paths.stagebank / shards.round_dirname(r) / "manifest.json").is_file()
    assert paths.round_checkpoints(r).is_dir()
  for phase in ("pretrain", "sft", "evaluation", "rollout", "update"):
    assert report["phase_seconds"][phase] > 0, phase
  # The tiny base (model.source = tiny_base): built here, its probe in the report.
  base = report["pretrain"]
  assert base["steps"] == cfg.pretrain.steps and base["probes"] == cfg.pretrain.probes
  assert 0.0 <= base["copy_accuracy"] <= 1.0 and base["seconds"] > 0
  assert 0.0 <= base["deep_copy_accuracy"] <= 1.0
  assert base["probe_depth"] == cfg.pretrain.probe_depth > 0
  report_md = (paths.workdir / "report.md").read_text()
  assert f"after {cfg.pretrain.probe_depth} tokens" in report_md
  assert f"jaxlib {base['host']['jaxlib']})" in report_md   # the machine that built the base
  # One run secret keys the held-out cells: every evaluation saw the same cells (the gate's
  # pairing), and the secret lives host-side only, readable by the run alone.
  assert os.stat(paths.eval_secret).st_mode & 0o777 == 0o600
  digests = {json.loads(paths.eval_report(p).read_text())["cell_set_digest"]
             for p in _policies(cfg)}
  assert len(digests) == 1


def test_end_to_end_rounds_follow_the_curriculum_and_the_gate(finished_run):
  cfg, paths, report = finished_run
  state = OuterState.load(paths.workdir)
  assert [e["policy"] for e in report["evaluations"]] == _policies(cfg)
  assert len(state.rounds) == cfg.grpo.rounds
  # argmin: the first target is the SFT policy's weakest scored stage (ties -> earliest).
  sft_scores = {s: v for s, v in state.evaluations["sft"]["stage_scores"].items()
                if v is not None}
  assert state.rounds[0].target == min(sft_scores, key=lambda s: (sft_scores[s],
                                                                   workflow.STAGES.index(s)))
  baseline = "sft"
  for r, rec in enumerate(state.rounds):
    assert rec.round == r and rec.start_policy == baseline
    assert [s["step"] for s in rec.steps] == list(range(1, cfg.grpo.steps_per_round + 1))
    assert all(np.isfinite(s["loss"]) and "reward_mean" in s for s in rec.steps)
    assert rec.promoted == rec.gate["passed"] and "training_healthy" in rec.gate["checks"]
    baseline = rec.candidate if rec.promoted else baseline
  assert state.baseline == baseline == report["baseline"]


def test_end_to_end_steps_without_signal_change_no_weights(finished_run):
  """Tied rewards in every group give no signal: no update (not even a KL-only Adam step)."""
  _, paths, _ = finished_run
  weights = lambda p: sorted(f.read_bytes() for f in paths.policy(p).glob("*.safetensors"))
  for rec in OuterState.load(paths.workdir).rounds:
    for s in rec.steps:
      assert s["no_signal"] in (0.0, 1.0)
      if s["no_signal"]:
        assert s["update_applied"] == 0 and s["grad_norm"] == 0
    if all(s["no_signal"] for s in rec.steps):
      assert weights(rec.candidate) == weights(rec.start_policy)


def test_end_to_end_applies_a_grpo_update(finished_run):
  """`tiny:smoke`'s samples differ within a group (in rubric reward, or in failed calls and
  malformed turns, which its `grpo.failed_call_penalty` charges), so GRPO applies an update:
  the update path (advantages, step, checkpoint, export) is in the run."""
  cfg, paths, report = finished_run
  assert cfg.grpo.failed_call_penalty > 0  # what makes the smoke run's signal box-independent
  assert report["grpo_steps_applied"] >= 1
  applied = [(rec, s) for rec in OuterState.load(paths.workdir).rounds for s in rec.steps
             if s["update_applied"]]
  assert len(applied) == report["grpo_steps_applied"]
  assert all(s["grad_norm"] > 0 and (s["reward_std"] > 0 or s["failed_turns"] > 0)
             for _, s in applied)
  weights = lambda p: sorted(f.read_bytes() for f in paths.policy(p).glob("*.safetensors"))
  rec = applied[0][0]
  assert weights(rec.candidate) != weights(rec.start_policy)


def test_end_to_end_rerun_of_a_finished_run_returns_its_report(finished_run):
  cfg, paths, report = finished_run
  # Which side moved, if one does: the cached evaluation, the saved state or the rerun. (The
  # standard errors once did: the file's tracks are sorted by name, and a plain float sum over
  # another order differs in the last bits; `report.standard_error` sums exactly.)
  saved_evaluations = OuterState.load(paths.workdir).evaluations
  for e in report["evaluations"]:
    cached = headline(json.loads(paths.eval_report(e["policy"]).read_text()))
    saved = saved_evaluations[e["policy"]]
    assert {k: e[k] for k in cached} == cached, ("evals file", e["policy"])
    assert {k: saved[k] for k in cached} == cached, ("outer state", e["policy"])
  assert run(cfg, paths.workdir)["evaluations"] == report["evaluations"]


def test_end_to_end_scores_the_accepted_policy_on_heldback_cells(finished_run, tmp_path):
  """After the last round the SFT and the accepted policy are scored on held-back cells (the
  same measurement, tasks no gate saw). When no round of the shared run passed, a copy of it
  with its last round promoted by hand runs the same final phase (its rounds are done, so
  `run` goes straight to it)."""
  cfg, paths, report = finished_run
  assert cfg.evaluator.heldback_cells_per_track >= 1
  if report["baseline"] == "sft":
    assert report["accepted_vs_sft_heldback"] is None and not report["heldback_evaluations"]
    assert not paths.eval_report(heldback_name("sft")).exists()
    shutil.copytree(paths.workdir, tmp_path / "run", symlinks=True)
    paths = RunPaths(tmp_path / "run")
    state = OuterState.load(paths.workdir)
    state.baseline = state.rounds[-1].candidate
    state.save(paths.workdir)
    report = run(cfg, paths.workdir)  # inside the fixture's XLA cache: its compiles are reused
  state, accepted = OuterState.load(paths.workdir), report["baseline"]
  digest = lambda name: json.loads(paths.eval_report(name).read_text())["cell_set_digest"]
  cell_keys = lambda name: {p.name for p in (paths.eval_records(name) / "cells").glob("*.json")}
  for policy in ("sft", accepted):
    name = heldback_name(policy)
    assert digest(name) == digest(heldback_name("sft")) != digest("sft")
    assert cell_keys(name) and not cell_keys(name) & cell_keys("sft")
    # The policy scored is the one the gate scored (the same params).
    assert state.evaluations[name]["params_sha256"] == state.evaluations[policy]["params_sha256"]
  change = report["accepted_vs_sft_heldback"]
  assert change["cells"] == cfg.evaluator.heldback_cells_per_track * len(workflow.TRACKS)
  assert [e["policy"] for e in report["heldback_evaluations"]] == ["sft", accepted]
  assert "held-back cells" in (paths.workdir / "report.md").read_text()


@pytest.mark.parametrize("heldback", [0, 2])
def test_the_leak_markers_cover_the_heldback_cells(tmp_path, heldback):
  """Training never sees held-back content: the Stage Bank's (and the tiny base's) markers are
  written from the gate's cells and the held-back ones."""
  from bat_jax.bicurl.bank import write_markers
  from bat_jax.run_config import RunConfig
  from bat_jax.stagebank.build import load_matcher
  cfg = RunConfig.from_config(fast_config(evaluator__heldback_cells_per_track=heldback))
  cfg = dataclasses.replace(cfg, evaluation=dataclasses.replace(cfg.evaluation, secret="ab" * 32))
  matcher = load_matcher(write_markers(cfg, tmp_path / "markers.json"))
  probe = dataclasses.replace(cfg.evaluation, secret="ab" * 32).heldback(2).cells()
  found = [bool(matcher.find({"text": f"see task {c.instance().task_id}"})) for c in probe]
  assert all(found) if heldback else not any(found)
  assert len(cfg.heldout_cells()) == (cfg.evaluator.cells_per_track + heldback) * len(
      workflow.TRACKS)


def test_resume_with_another_config_is_refused_naming_the_field(tmp_path):
  from bat_jax.bicurl.state import check_same_config
  check_same_config(fast_config(), tmp_path / "config.json")
  check_same_config(fast_config(logging__tensorboard=False), tmp_path / "config.json")  # ok
  lr = fast_config().grpo.lr
  with pytest.raises(ValueError, match=rf"grpo: lr {re.escape(str(lr))} -> 0.5"):
    check_same_config(fast_config(grpo__lr=0.5), tmp_path / "config.json")
