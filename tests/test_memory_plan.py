"""The memory plan: real programs compiled abstractly, per-device bytes, layouts, exit status."""

import json
import os
import subprocess
import sys

import pytest

from bat_jax import memory_plan
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
  assert set(d["phases"]) == {"sft_step", "old_logp_pass", "ref_logp_pass", "grpo_step"}
  for name, phase in d["phases"].items():
    assert phase["temp"] > 0 and phase["peak"] >= phase["temp"], name
  assert d["peak"] == max(p["peak"] for p in d["phases"].values())
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
  assert concurrent["budget"] == sequential["budget"] and sequential["fits"]
  assert set(sequential["compile_seconds"]) == set(concurrent["per_device"]["phases"])


def test_layouts_budget_the_rollout_share(tiny_plan):
  cfg, result = tiny_plan
  model_cfg = memory_plan.model_config(cfg)
  with cfg.unlocked():
    cfg.rollout.engine = "sglang"
    cfg.distributed.xla_mem_fraction = 0.25
  fixed = memory_plan.layout_budget(cfg, resident=GIB, context=256, model_cfg=model_cfg)
  assert fixed["jax"] == 20 * GIB and fixed["rollout_share"] == 60 * GIB
  with cfg.unlocked():
    cfg.memory.layout = "timeshare"
    cfg.rollout.sglang.mem_fraction_static = 0.9
  shared = memory_plan.layout_budget(cfg, resident=GIB, context=256, model_cfg=model_cfg)
  assert shared["jax"] == 76 * GIB and shared["rollout_fits"]
  # 72 GiB of SGLang beside 10 GiB that JAX keeps between steps does not fit an 80 GiB device.
  assert not memory_plan.layout_budget(cfg, resident=10 * GIB, context=256,
                                       model_cfg=model_cfg)["rollout_fits"]
  with cfg.unlocked():
    cfg.memory.layout = "split"
  with pytest.raises(ValueError, match="config.memory.layout='split'"):
    memory_plan.layout_budget(cfg, resident=GIB, context=256, model_cfg=model_cfg)


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
  proc, result = _run_plan(config, tmp_path)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "fits: true" in proc.stdout
  assert result["config"]["model_layers"] == 32 and result["config"]["mesh"]["fsdp"] == 8
  assert result["per_device"]["peak"] <= result["budget"]["jax"]
