"""The memory plan: real programs compiled abstractly, per-device bytes, layouts, exit status."""

import json
import os
import subprocess
import sys

import pytest

from bat_jax import memory_phases, memory_plan
from bat_jax.config_validation import batch_layout_problems
from bat_jax.train import trainer as trainer_module
from configs import bat4b, bat9b, tiny

GIB = 2**30


def small_tiny():
  """configs/tiny.py:smoke (2 layers, 32 wide) at a few hundred tokens (KL on), so the default
  suite compiles it quickly."""
  cfg = tiny.get_config("smoke")
  with cfg.unlocked():
    cfg.sft.max_seq_len, cfg.sft.global_batch_size, cfg.sft.micro_batches = 128, 2, 1
    cfg.grpo.prompt_groups, cfg.grpo.group_size, cfg.grpo.micro_batches = 1, 2, 1
    cfg.rollout.limits.max_context_tokens = 256
    cfg.grpo.kl_coef = 0.01
  return cfg


@pytest.fixture(scope="module")
def tiny_plan():
  # Two compiles at a time, as the CLI does on this box (the slow test below compares with
  # one at a time and with LLVM's optimisation on).
  return small_tiny(), memory_plan.plan(small_tiny(), workers=2)


def test_plan_counts_state_bytes_and_compiles_every_program(tiny_plan):
  cfg, result = tiny_plan
  d = result["per_device"]
  model_cfg = memory_plan.model_config(cfg)
  n_params = memory_plan.rollout_need(cfg, model_cfg, 1)["params_count"]
  assert d["params"] == 4 * n_params == d["gradients"]      # fp32 on one device
  assert 2 * d["params"] <= d["optimizer"] <= 2 * d["params"] + 64  # mu, nu, step counters
  assert d["reference"] == 4 * n_params                     # tiny keeps the reference fp32
  assert d["export_cast"] == 2 * n_params                   # the bf16 export
  # grpo.old_logp = "step": the update scores its own old logprobs, so no old-logprob pass.
  assert set(d["programs"]) == {"sft_step", "ref_logp_pass", "grpo_step"}
  for name, program in d["programs"].items():
    assert program["temp"] > 0 and program["extra"] >= program["temp"], name
  table = result["phases"]
  assert set(table["totals"]) == set(memory_phases.PHASES)
  grpo = {k: v["grpo_step"] for k, v in table["components"].items()}
  # The rounds hold no fp32 SFT policy (bicurl.loop.sft_reference): only its KL reference.
  assert "SFT policy" not in table["components"]
  assert grpo["training params (round start)"] == d["params"]
  assert grpo["KL reference"] == d["reference"]
  assert grpo["step program (temp + I/O)"] == max(
      p["extra"] for n, p in d["programs"].items() if n != "sft_step")
  assert table["totals"]["grpo_step"] == sum(grpo.values())
  assert result["config"]["grpo_batch"] == [2, 256] and result["config"]["sft_batch"] == [2, 128]
  assert result["fits"] is True
  json.dumps(result)  # the --json output is plain JSON


@pytest.mark.slow
def test_concurrent_compiles_without_llvm_optimisation_give_the_same_figures(tiny_plan,
                                                                             monkeypatch):
  # tiny_plan compiled two programs at a time with the plan's options (no LLVM optimisation);
  # here one at a time with the trainer's default options, from an empty program cache.
  monkeypatch.setattr(trainer_module, "_COMPILED", {})
  monkeypatch.setattr(memory_plan, "PLAN_COMPILER_OPTIONS", {})
  _, concurrent = tiny_plan
  sequential = memory_plan.plan(small_tiny(), workers=1)
  assert len(trainer_module._COMPILED) == 4   # every program compiled again, none shared
  assert concurrent["per_device"] == sequential["per_device"]
  assert concurrent["phases"] == sequential["phases"] and sequential["fits"]
  assert set(sequential["compile_seconds"]) == set(concurrent["per_device"]["programs"])


def _holdings(**kw) -> memory_phases.Holdings:
  values = dict(sft_params=4 * GIB, sft_optimizer=8 * GIB, sft_program=30 * GIB,
                params=4 * GIB, optimizer=8 * GIB, reference=2 * GIB, sft_policy=4 * GIB,
                export_cast=2 * GIB, grpo_program=40 * GIB, rollout_need=20 * GIB)
  return memory_phases.Holdings(**{**values, **kw})


def _sglang_cfg(layout: str, **memory):
  cfg = bat9b.get_config()
  with cfg.unlocked():
    cfg.memory.layout = layout
    cfg.distributed.xla_mem_fraction = 0.5 if layout == "fraction" else None
    for k, v in memory.items():
      setattr(cfg.memory, k, v)
  return cfg


def test_the_rollout_share_is_a_fraction_of_the_memory_free_when_it_starts():
  # bat9b: 79.6 GiB cards, 1.5 GiB contexts each for JAX and SGLang; JAX holds the SFT policy
  # at launch (timeshare) or its whole preallocated pool (fraction); SGLang takes 0.6 of the rest.
  timeshare = memory_phases.phase_table(_sglang_cfg("timeshare"), _holdings())
  free = 79.6 * GIB - 1.5 * GIB - 4 * GIB - 1.5 * GIB
  assert timeshare["rollout"]["free_at_launch"] == pytest.approx(free, abs=2)
  assert timeshare["rollout"]["static"] == pytest.approx(0.6 * free, abs=2)
  fraction = memory_phases.phase_table(_sglang_cfg("fraction"), _holdings())
  assert fraction["rollout"]["jax_pool"] == int(0.5 * 79.6 * GIB)
  assert fraction["rollout"]["free_at_launch"] == pytest.approx(
      79.6 * GIB - 3 * GIB - 0.5 * 79.6 * GIB, abs=2)
  # The pool is held whole in every phase: each phase's JAX rows + unused pool = pool + context.
  for phase in memory_phases.PHASES:
    rows = {k: v[phase] for k, v in fraction["components"].items()}
    jax_rows = sum(v for k, v in rows.items() if not k.startswith("rollout server"))
    assert jax_rows >= fraction["rollout"]["jax_pool"] + 1.5 * GIB - 2, phase


def test_each_phase_counts_what_the_loop_holds_and_the_released_server():
  table = memory_phases.phase_table(_sglang_cfg("timeshare"), _holdings())
  c = table["components"]
  assert "SFT policy" not in c  # dropped once the server started (its share counts it)
  assert c["KL reference"] == {"sft": 0, "evaluation/export": 2 * GIB, "rollout": 2 * GIB,
                               "grpo_step": 2 * GIB}
  assert c["export cast (bf16 slices)"]["rollout"] == 2 * GIB
  assert c["export cast (bf16 slices)"]["grpo_step"] == 0
  static = table["rollout"]["static"]
  assert c["rollout server static share (weights + KV)"] == {
      "sft": 0, "evaluation/export": static, "rollout": static, "grpo_step": 0}  # released
  assert c["rollout server context + graphs (margin)"]["grpo_step"] == 4 * GIB
  # grpo_step: 1.5 + 4 + 8 + 2 + 40 + 4 (released server) = 59.5 GiB of 79.6.
  assert table["totals"]["grpo_step"] == pytest.approx(59.5 * GIB, abs=8)
  assert table["fits"]["grpo_step"] and table["all_fit"]
  tight = memory_phases.phase_table(_sglang_cfg("timeshare"), _holdings(grpo_program=57 * GIB))
  assert tight["headroom"]["grpo_step"] == pytest.approx(3.1 * GIB, abs=8)   # < 4 GiB needed
  assert not tight["fits"]["grpo_step"] and not tight["all_fit"]
  short = memory_phases.phase_table(_sglang_cfg("timeshare"), _holdings(rollout_need=60 * GIB))
  assert not short["rollout_fits"] and not short["all_fit"]
  with pytest.raises(ValueError, match="config.memory.layout='split'"):
    memory_phases.phase_table(_sglang_cfg("split"), _holdings())


def test_hosts_plan_refuses_a_micro_batch_that_does_not_split():
  cfg = bat9b.get_config()
  assert memory_plan.plan_devices(cfg) == 8 and batch_layout_problems(cfg, 1) == []
  devices = memory_plan.plan_devices(cfg, hosts=2)
  errors = batch_layout_problems(cfg, 2)
  assert devices == 16 and len(errors) == 2, errors
  assert ("config.grpo.prompt_groups x config.grpo.group_size / config.grpo.micro_batches = 8 "
          "rows does not split over the 16 devices") in errors[1]
  assert memory_plan.plan_devices(bat9b.get_config("hosts=2")) == 8  # the flag decides


@pytest.mark.parametrize("module", [bat9b, bat4b])
def test_reference_context_cap_holds_every_limit_at_once(module):
  limits = module.get_config().rollout.limits
  # 16,384 response tokens + 23 observations of 2,048 ASCII characters (<= 1 token each).
  assert limits.max_context_tokens >= 16384 + 23 * 2048 + 4096
  assert module.get_config().rollout.jax.max_len == limits.max_context_tokens


def _run_plan(config: str, tmp_path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict]:
  out = tmp_path / "plan.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "bat_jax.memory_plan", f"--config={config}",
                         f"--json={out}", *overrides], capture_output=True, text=True,
                        env=env, timeout=1200)
  return proc, (json.loads(out.read_text()) if out.is_file() else {})


@pytest.mark.slow
def test_cli_exits_nonzero_when_the_plan_does_not_fit(tmp_path):
  proc, result = _run_plan("configs/tiny.py", tmp_path, "--config.memory.device_gib=0.01")
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "fits: false" in proc.stdout and result["fits"] is False


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/bat9b.py", "configs/bat4b.py"])
def test_reference_configs_fit_one_8x80gb_node(config, tmp_path):
  # Issue 25: every phase keeps memory.headroom_gib (4) free on a 79.6 GiB card; bat9b's GRPO
  # step phase leaves 10.47 (no moment copies in the step, attention layers saving only their
  # input, no resident fp32 SFT policy).
  proc, result = _run_plan(config, tmp_path)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "fits: true" in proc.stdout
  assert result["config"]["model_layers"] == 32
  phases = result["phases"]
  assert all(phases["fits"].values()) and phases["rollout_fits"]
  assert phases["headroom_required"] >= 4 * 2**30
  assert all(free >= phases["headroom_required"] for free in phases["headroom"].values())


def test_cli_hosts_refuses_the_bat9b_micro_batch_on_two_hosts(tmp_path):
  proc, result = _run_plan("configs/bat9b.py", tmp_path, "--hosts=2")
  assert proc.returncode == 2 and result == {}, proc.stderr[-2000:]
  assert "memory plan refused (2 host(s), 16 devices)" in proc.stderr
  assert "config.grpo.micro_batches = 8 rows does not split over the 16 devices" in proc.stderr
