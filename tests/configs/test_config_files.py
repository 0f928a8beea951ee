"""The config tree: loads, is locked, validates, and bat4b/bat9b carry the released recipe."""

import json
import pathlib

import pytest
import transformers
from absl import flags
from ml_collections import config_flags

from bat_jax import curriculum, gate, workflow
from bat_jax.config_validation import ConfigError, field_problems, validate_config
from bat_jax.run_config import RunConfig
from configs import base, bat4b, bat9b, qwen_reference, tiny, tiny_sweeps

ROOT = pathlib.Path(__file__).resolve().parents[2]
# An unchanged copy of the public BaT release's bat-reference.json (MIT, per the release's
# README), kept beside this test so it runs on a clean checkout.
REFERENCE = json.loads((pathlib.Path(__file__).with_name("bat-reference.json")).read_text())

RUNNABLE = {
    "tiny": lambda: tiny.get_config(),
    "tiny:smoke": lambda: tiny.get_config("smoke"),
    "bat4b": lambda: bat4b.get_config(),
    "bat9b": lambda: bat9b.get_config("ckpt=/data/qwen9b,hosts=2"),
}


def parse_flags(*args: str):
  """A tiny absl entry point: what `launch.py` does with its argv."""
  argv = ["launch.py", *args]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "run config", flag_values=values,
                                  lock_config=True, sys_argv=argv)
  values(argv)
  return values.config


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_configs_load_locked_and_valid(name):
  cfg = RUNNABLE[name]()
  assert cfg.is_locked
  with pytest.raises(AttributeError, match="cannot be added since the config is locked"):
    cfg.grpo.learning_rate = 1e-6
  validate_config(cfg)


def test_base_alone_names_the_missing_checkpoint():
  with pytest.raises(ConfigError, match=r"config\.model\.path: a pretrained model needs"):
    validate_config(base.get_config())


def test_overrides_through_absl_flags():
  cfg = parse_flags(f"--config={ROOT / 'configs/tiny.py'}:smoke", "--config.grpo.lr=2e-6",
                    "--config.curriculum.mode=softmin", "--config.rollout.sglang.urls=('u',)")
  assert cfg.grpo.lr == 2e-6 and cfg.curriculum.mode == "softmin"
  assert cfg.rollout.sglang.urls == ("u",)
  assert cfg.sft.steps == tiny.SMOKE_OVERRIDES["sft.steps"] != tiny.SFT_STEPS  # `smoke` applied
  validate_config(cfg)


def test_misspelt_override_fails_naming_the_field():
  with pytest.raises(AttributeError, match='Did you mean "lr" instead of "lrr"'):
    parse_flags(f"--config={ROOT / 'configs/tiny.py'}", "--config.grpo.lrr=2e-6")
  with pytest.raises(flags.IllegalFlagValueError, match="config.grpo.steps_per_round"):
    parse_flags(f"--config={ROOT / 'configs/tiny.py'}", "--config.grpo.steps_per_round=many")


@pytest.mark.parametrize("override, message", [
    ("--config.curriculum.mode=argminn", "config.curriculum.mode: unknown mode 'argminn'"),
    ("--config.grpo.advantage.mode=ppo", "config.grpo.advantage.mode: 'ppo' is not one of"),
    ("--config.rollout.engine=vllm", "config.rollout.engine: 'vllm' is not one of"),
    ("--config.evaluator.tier=hard", "config.evaluator.tier: 'hard' is not one of"),
    ("--config.evaluator.kind=external", "config.evaluator.external.argv: must be a non-empty"),
    ("--config.evaluator.kind=external",
     "config.evaluator.heldback_cells_per_track: held-back cells are the built-in evaluator's"),
    ("--config.evaluator.heldback_cells_per_track=-1",
     "config.evaluator.heldback_cells_per_track: -1 is outside its valid range [0, 100000]"),
    ("--config.gate.max_task_drop=-0.1", "config.gate.max_task_drop: must be a finite number"),
    ("--config.grpo.group_size=1", "config.grpo.group_size: must be >= 2"),
    ("--config.grpo.micro_batches=5", "config.grpo.micro_batches: 5 does not divide the 12"),
    ("--config.rollout.limits.max_tool_calls=30", "config.rollout.limits.max_tool_calls: 30"),
    ("--config.mesh.fsdp=0", "config.mesh.fsdp: must be -1"),
    ("--config.rollout.sampling.top_p=1.5", "config.rollout.sampling: "),
    ("--config.rollout.sampling.temperature=0", "config.rollout.sampling.temperature: must be"),
    ("--config.rollout.limits.max_observation_chars=0", "config.rollout.limits: "),
    ("--config.sandbox.memory_mb=0", "config.sandbox: SandboxLimits.memory_mb must be"),
    ("--config.rollout.jax.max_len=1024", "config.rollout.jax.max_len: 1024 is below"),
    ("--config.sharding.rules=(('embed','fsdpp'),)",
     "config.sharding.rules[0]: 'embed' maps to unknown mesh axes ['fsdpp']"),
    ("--config.grpo.loss_agg=token-sum", "config.grpo: unknown loss_agg 'token-sum'"),
    ("--config.grpo.kl_reference=init", "config.grpo.kl_reference: 'init' is not one of"),
    ("--config.grpo.tis_cap=0", "config.grpo: tis_cap must be > 0"),
    ("--config.sft.context_loss_weight=-0.5", "config.sft.context_loss_weight: must be a number"),
    ("--config.grpo.dual_clip=1.0", "config.grpo: dual_clip must be > 1"),
    ("--config.grpo.loss_norm_length=0", "config.grpo.loss_norm_length: must be > 0"),
    ("--config.distributed.enabled=true --config.distributed.num_processes=3",
     "config.grpo.prompt_groups: 4 state_id groups do not split evenly over"),
    ("--config.model.source=pretrained", "config.model.path: a pretrained model needs"),
    ("--config.model.hf_config.num_hidden_layers=3",
     "config.model.hf_config.layer_types: has 4 entries but num_hidden_layers = 3"),
])
def test_bad_values_fail_validation_naming_the_field(override, message):
  cfg = parse_flags(f"--config={ROOT / 'configs/tiny.py'}", *override.split())
  with pytest.raises(ConfigError) as error:
    validate_config(cfg)
  assert message in str(error.value)


def test_vocab_size_follows_the_tokenizer_override():
  cfg = parse_flags(f"--config={ROOT / 'configs/tiny.py'}",
                    "--config.tokenizer.train.vocab_size=777")
  assert cfg.model.hf_config.vocab_size == 777


def test_unlinked_model_vocab_smaller_than_tokenizer_is_named():
  cfg = base.base_config()
  cfg.model.source, cfg.tokenizer.source = "scratch", "train"
  cfg.model.hf_config = tiny.tiny_qwen3_5_text(vocab_size=256)
  cfg.tokenizer.train.vocab_size = 1024
  with pytest.raises(ConfigError, match="config.model.hf_config.vocab_size: 256 is smaller"):
    validate_config(cfg)


def test_tiny_default_pretrains_the_tiny_base_first():
  cfg = tiny.get_config()
  assert tiny.get_config("base").to_dict() == cfg.to_dict()   # `base` is the default
  assert cfg.model.source == "tiny_base" and cfg.pretrain.steps >= 100
  # Lists of 2-6 in 32-token rows cross the copying plateau by ~80 steps, 4-13 in 64 by ~150.
  assert cfg.pretrain.echo_steps >= 80 and cfg.pretrain.echo_long_steps >= 100
  assert cfg.pretrain.echo_seq_len < cfg.pretrain.echo_long_seq_len   # short -> long
  assert cfg.model.hf_config.rope_parameters.partial_rotary_factor == 1.0
  assert tiny.get_config("scratch").model.hf_config.rope_parameters.partial_rotary_factor == 0.25
  assert set(cfg.model.hf_config.layer_types) == {"linear_attention", "full_attention"}
  smoke = tiny.get_config("smoke,base")
  assert smoke.model.source == "tiny_base" and smoke.pretrain.steps < 10
  assert 0 < smoke.pretrain.echo_steps < 10 and smoke.pretrain.echo_long_steps == 0
  assert smoke.pretrain.extend_steps == 0   # two phases: tests/pretrain covers all four
  # Context extension: rows as long as a task's episode (SFT rows reach ~1,150 tokens), and the
  # deep probe scores copying past the corpus rows' length, where the episode's calls are.
  assert cfg.pretrain.extend_steps >= 100 and cfg.pretrain.extend_seq_len >= 1024
  assert cfg.pretrain.seq_len < cfg.pretrain.probe_depth < cfg.pretrain.extend_seq_len
  assert len(smoke.model.hf_config.layer_types) == smoke.model.hf_config.num_hidden_layers
  assert tiny.get_config("smoke").model.source == "scratch"   # the tests' fast path
  # Issue 23: the default main job makes >= 24 GRPO steps, each on its own Stage Bank batch.
  assert cfg.grpo.rounds * cfg.grpo.steps_per_round >= 24
  assert cfg.stagebank.n_batches >= cfg.grpo.steps_per_round
  with pytest.raises(ValueError, match="`base` and `scratch` exclude each other"):
    tiny.get_config("base,scratch")


def test_deltanet_first_reorders_only_the_base_layers():
  default, reordered = tiny.get_config().to_dict(), tiny.get_config("deltanet_first").to_dict()
  layers = reordered["model"]["hf_config"].pop("layer_types")
  assert layers[0] == "linear_attention" and set(layers[1:]) == {"full_attention"}
  assert sorted(layers) == sorted(default["model"]["hf_config"].pop("layer_types"))
  assert reordered == default   # the same model otherwise (its base's cache key differs)
  for arg in ("scratch,deltanet_first", "smoke,deltanet_first"):
    with pytest.raises(ValueError, match="`deltanet_first` orders the tiny base's layers"):
      tiny.get_config(arg)


def test_config_argument_errors_name_the_key():
  with pytest.raises(ValueError, match="config argument: unknown key 'smok'"):
    tiny.get_config("smok")
  with pytest.raises(ValueError, match="config argument 'rounds': cannot read 'x' as int"):
    tiny.get_config("rounds=x")
  assert tiny.get_config("rounds=5,mode=uniform").grpo.rounds == 5


def test_tiny_scratch_is_a_small_hybrid_qwen3_5_from_scratch():
  cfg = tiny.get_config("scratch")
  hf = cfg.model.hf_config.to_dict()
  assert cfg.model.source == "scratch" and cfg.tokenizer.source == "train"
  assert hf["model_type"] == "qwen3_5_text"
  assert set(hf["layer_types"]) == {"linear_attention", "full_attention"}
  assert cfg.rollout.engine == "jax" and cfg.distributed.enabled is False
  # Every field is a real Qwen3.5 text config field (HF would silently keep a misspelt one).
  known = set(transformers.Qwen3_5TextConfig().to_dict())
  assert set(hf) <= known, set(hf) - known
  hf_cfg = transformers.Qwen3_5TextConfig(**{**hf, "layer_types": list(hf["layer_types"])})
  assert hf_cfg.hidden_size == 128 and hf_cfg.layer_types[1] == "full_attention"


def test_gpu_configs_use_local_checkpoints_sglang_and_an_8_gpu_mesh():
  for module, size in ((bat4b, "4B"), (bat9b, "9B")):
    cfg = module.get_config()
    assert cfg.model.path == f"/models/Qwen3.5-{size}" == cfg.tokenizer.path
    assert cfg.model.source == "pretrained" and len(cfg.model.hf_config) == 0
    assert cfg.rollout.engine == "sglang"
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (-1, 8, 1)
    assert cfg.distributed.enabled is False
  multi = bat9b.get_config("hosts=4")
  assert multi.distributed.enabled and multi.distributed.num_processes == 4
  with pytest.raises(ValueError, match="'13B'"):
    qwen_reference.get_reference_config("13B")


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_reference_micro_batches_split_over_every_gpu_on_any_number_of_hosts(hosts):
  cfg = bat9b.get_config(f"hosts={hosts}")
  assert field_problems(cfg) == []
  assert cfg.sft.micro_batches == cfg.grpo.micro_batches == 4 // hosts
  # One row per GPU per micro-batch (8 GPUs a host), the recipe's global batch of 32.
  assert cfg.sft.global_batch_size // cfg.sft.micro_batches == 8 * hosts
  assert cfg.sft.global_batch_size == 32


def test_a_micro_batch_that_cannot_split_over_two_hosts_is_refused():
  cfg = bat9b.get_config("hosts=2")
  cfg.unlock()
  cfg.sft.micro_batches = cfg.grpo.micro_batches = 4  # 8 rows over 16 GPUs
  problems = field_problems(cfg)
  assert any(p.startswith("config.sft.global_batch_size / config.sft.micro_batches = 8 rows")
             and "16 devices" in p and "hosts=2" in p for p in problems), problems
  assert any(p.startswith("config.grpo.prompt_groups x config.grpo.group_size / "
                          "config.grpo.micro_batches = 8 rows") for p in problems), problems
  with pytest.raises(ConfigError, match="config.sft.micro_batches = 8 rows"):
    validate_config(cfg)


GPU_CONFIGS = pytest.mark.parametrize("module", [bat4b, bat9b], ids=["bat4b", "bat9b"])
TRAINING = REFERENCE["training"]


@GPU_CONFIGS
def test_gpu_configs_match_the_reference_sft(module):
  cfg, sft = module.get_config(), TRAINING["cold_start_sft"]
  assert cfg.model.dtype == {"bf16": "bfloat16"}[sft["precision"]]
  assert cfg.sft.max_seq_len == sft["max_sequence_tokens"]
  assert cfg.sft.global_batch_size == sft["global_batch_size"]
  assert cfg.sft.micro_batches == sft["gradient_accumulation_steps"]
  # 8 GPUs x per-device batch x accumulation = global batch.
  assert 8 * sft["per_device_batch_size"] * cfg.sft.micro_batches == cfg.sft.global_batch_size
  assert cfg.sft.lr == sft["learning_rate"]
  assert cfg.sft.steps == sft["max_steps"]
  assert cfg.sft.validation_fraction == sft["validation_fraction"]
  assert cfg.sft.max_validation_examples == sft["max_validation_examples"]
  assert cfg.sft.checkpoint.every == sft["checkpoint_interval_steps"]
  assert cfg.sft.checkpoint.keep == sft["checkpoint_retention"]


@GPU_CONFIGS
def test_gpu_configs_match_the_reference_grpo_and_topology(module):
  cfg, grpo = module.get_config(), TRAINING["grpo"]
  assert cfg.grpo.rounds == grpo["reference_rounds"]
  assert cfg.grpo.steps_per_round == grpo["steps_per_round"]
  assert cfg.grpo.prompt_groups == grpo["prompt_groups_per_batch"]
  assert cfg.grpo.group_size == grpo["continuations_per_state"]
  assert cfg.grpo.lr == grpo["learning_rate"]
  assert cfg.grpo.kl_coef == grpo["actor_kl_loss_coefficient"]
  assert grpo["use_kl_in_reward"] is False    # the code has no KL-in-reward path at all
  assert cfg.grpo.advantage.std_normalize == grpo["normalize_advantage_by_std"]
  assert {"seq-mean-token-mean": "sequence_mean_then_token_mean"}[cfg.grpo.loss_agg] == (
      grpo["loss_aggregation"])
  assert cfg.rollout.sampling.temperature == grpo["sampling_temperature"]
  assert cfg.grpo.checkpoint.every == grpo["checkpoint_interval_steps"]
  assert cfg.grpo.checkpoint.keep == grpo["checkpoint_retention"]
  topology = grpo["reference_eight_gpu_topology"]
  assert cfg.rollout.sglang.tp_size == topology["rollout_tensor_parallel_size"]
  assert cfg.rollout.sglang.dp_size == topology["rollout_replicas"]


@GPU_CONFIGS
def test_gpu_configs_match_the_reference_turn_limits(module):
  cfg, turns = module.get_config(), TRAINING["multi_turn"]
  assert cfg.rollout.limits.max_assistant_turns == turns["max_assistant_turns"]
  assert cfg.rollout.limits.max_tool_calls == turns["max_tool_calls"]
  assert cfg.rollout.limits.max_tool_calls == turns["max_tool_response_turns"]
  assert cfg.rollout.limits.max_response_tokens == turns["max_cumulative_response_tokens"]
  assert cfg.rollout.limits.max_observation_chars == turns["max_tool_observation_characters"]


@GPU_CONFIGS
def test_gpu_configs_match_the_reference_round_view(module):
  cfg = module.get_config()
  view = REFERENCE["data"]["round_view"]
  assert cfg.curriculum.pool_mix.to_dict() == view["pool_rows_per_batch"]
  assert sum(cfg.curriculum.pool_mix.to_dict().values()) == view["rows_per_batch"]
  assert cfg.stagebank.n_batches == view["complete_batches"]
  assert cfg.stagebank.n_batches * view["rows_per_batch"] == view["rows"]


@GPU_CONFIGS
def test_gpu_configs_match_the_reference_gate(module):
  cfg = module.get_config()
  run = RunConfig.from_config(cfg)
  ref_gate = REFERENCE["promotion_gate"]
  assert cfg.gate.max_overall_drop == ref_gate["maximum_overall_drop"]
  assert cfg.gate.max_task_drop == ref_gate["maximum_task_drop"]
  assert cfg.gate.max_track_drop == ref_gate["maximum_per_track_drop"]
  assert cfg.gate.max_stage_drop == ref_gate["maximum_s3_s5_stage_drop"]
  assert cfg.gate.guarded_stages == ("S3", "S4", "S5")
  assert cfg.gate.catastrophic_overall_drop == ref_gate["catastrophic_overall_drop"]
  assert run.gate == gate.GateThresholds()


@GPU_CONFIGS
def test_gpu_configs_match_the_reference_target_selection(module):
  cfg, view = module.get_config(), REFERENCE["data"]["round_view"]
  run = RunConfig.from_config(cfg)
  selection = REFERENCE["target_selection"]
  assert cfg.curriculum.mode == "argmin"
  assert tuple(selection["stage_order"]) == workflow.STAGES
  # The configured curriculum applies the release's pool mix.
  pool = curriculum.weights({"S1": 0.5}, None, True, run.curriculum).pool_mix
  assert pool == {p: n / view["rows_per_batch"] for p, n in view["pool_rows_per_batch"].items()}
  assert {s["id"]: s["agentic_weight"] for s in REFERENCE["stages"]} == dict(
      workflow.STAGE_WEIGHTS)


@pytest.mark.parametrize("sweep", sorted(tiny_sweeps.SWEEPS))
def test_sweeps_apply_to_tiny_and_validate(sweep):
  variants = tiny_sweeps.get_sweep(sweep)
  assert len({label for label, _ in variants}) == len(variants) >= 2
  steps = set()
  for _, overrides in variants:
    cfg = tiny_sweeps.apply_overrides(tiny.get_config(), overrides)
    validate_config(cfg)
    assert cfg.is_locked
    for path, value in overrides.items():
      node = cfg
      for part in path.split("."):
        node = node[part]
      assert node == value
    steps.add((cfg.grpo.rounds, cfg.grpo.steps_per_round,
               cfg.grpo.prompt_groups * cfg.grpo.group_size))
  assert len(steps) == 1      # every variant trains on the same number of trajectories


def test_curriculum_sweep_covers_every_mode_and_bad_paths_fail():
  modes = {o["curriculum.mode"] for _, o in tiny_sweeps.get_sweep("curriculum_mode")}
  assert modes == set(curriculum.MODES)
  with pytest.raises(KeyError, match="lrr"):
    tiny_sweeps.apply_overrides(tiny.get_config(), {"grpo.lrr": 1.0})
  with pytest.raises(ValueError, match="unknown sweep 'modes'"):
    tiny_sweeps.get_sweep("modes")


def test_tiny_model_builds_and_every_param_axis_has_a_sharding_rule():
  import jax
  from flax import nnx

  from bat_jax import sharding
  from bat_jax.model import ModelConfig, build_model

  cfg = tiny.get_config("smoke")
  model_cfg = ModelConfig.from_hf_dict(cfg.model.hf_config.to_dict(), dtype=cfg.model.dtype,
                                       param_dtype=cfg.model.param_dtype)
  assert model_cfg.vocab_size == cfg.tokenizer.train.vocab_size
  model = build_model(model_cfg, rngs=nnx.Rngs(0))      # tiny:smoke: 32 wide, 2 layers
  mesh = sharding.make_mesh(data=-1, fsdp=8, tensor=cfg.mesh.tensor)   # 8 fake CPU devices
  # Raises KeyError naming any logical axis that the config's rules do not cover.
  shardings = sharding.model_shardings(model, mesh, cfg.sharding.rules)
  specs = [s.spec for s in jax.tree.leaves(shardings)]
  assert len(specs) > 10
  assert any("fsdp" in str(spec) for spec in specs)    # params really are FSDP-sharded


def test_tis_needs_an_engine_that_returns_sampler_logprobs(monkeypatch):
  from bat_jax import config_validation
  cfg = parse_flags(f"--config={ROOT / 'configs/tiny.py'}", "--config.grpo.tis_cap=2.0")
  validate_config(cfg)  # jax and sglang both return them
  monkeypatch.setattr(config_validation, "ENGINES_WITH_SAMPLER_LOGPROBS", ("sglang",))
  with pytest.raises(ConfigError, match="config.grpo.tis_cap: truncated IS needs sampler "
                     "logprobs, which rollout.engine 'jax' does not return"):
    validate_config(cfg)


def test_grpo_loss_defaults_follow_verl():
  cfg = base.get_config()
  assert cfg.grpo.dual_clip == 3.0 and cfg.grpo.kl_reference == "sft"
  assert cfg.grpo.loss_norm_length is None   # -> rollout.limits.max_response_tokens


def test_token_sum_norm_loss_gets_its_constant_length_from_the_run():
  """`grpo.loss_norm_length` None means the rollout's max response length, in the loss the run
  builds as in validation (the run used to build the loss without it and fail at its first
  step)."""
  from bat_jax.grpo import grpo_loss_fn
  from bat_jax.run_programs import grpo_config
  tiny = f"--config={ROOT / 'configs/tiny.py'}"
  cfg = parse_flags(tiny, "--config.grpo.loss_agg=seq-mean-token-sum-norm")
  validate_config(cfg)
  assert grpo_config(cfg).norm_length == cfg.rollout.limits.max_response_tokens == 768
  grpo_loss_fn(grpo_config(cfg))
  cfg = parse_flags(tiny, "--config.grpo.loss_agg=seq-mean-token-sum-norm",
                    "--config.grpo.loss_norm_length=500")
  assert grpo_config(cfg).norm_length == 500


def test_adam_eps_reaches_each_phase_optimizer_and_must_be_positive():
  from bat_jax.run_programs import optimizer_config
  cfg = parse_flags(f"--config={ROOT / 'configs/tiny.py'}", "--config.grpo.adam_eps=1e-3")
  validate_config(cfg)
  assert optimizer_config(cfg.grpo, 12).eps == 1e-3
  assert optimizer_config(cfg.sft, 1).eps == 1e-8
  with pytest.raises(ConfigError, match="grpo.adam_eps"):
    validate_config(parse_flags(f"--config={ROOT / 'configs/tiny.py'}",
                                "--config.grpo.adam_eps=0"))


@pytest.mark.parametrize("field, value, bad", [("pg_min_entropy", 0.3, -1),
                                               ("pg_prob_weight", 1.0, 1.5)])
def test_a_token_weighting_field_reaches_the_grpo_loss_and_is_bounded(field, value, bad):
  from bat_jax.run_programs import grpo_config
  cfg = parse_flags(f"--config={ROOT / 'configs/tiny.py'}", f"--config.grpo.{field}={value}")
  validate_config(cfg)
  assert getattr(grpo_config(cfg), field) == value
  assert getattr(grpo_config(parse_flags(f"--config={ROOT / 'configs/tiny.py'}")), field) == 0.0
  with pytest.raises(ConfigError, match=f"grpo.{field}"):
    validate_config(parse_flags(f"--config={ROOT / 'configs/tiny.py'}",
                                f"--config.grpo.{field}={bad}"))
