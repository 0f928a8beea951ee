r"""The shared config tree, with the BaT reference recipe as its defaults.

Every config (`tiny.py`, `bat4b.py`, `bat9b.py`) starts from `base_config()` and overrides only
what differs. The recipe values come from the public BaT release
(its bat-reference.json, bundled as tests/configs/bat-reference.json and checked there); values the release does
not state are marked "not in the release" and are this project's choice.

Configs are locked, nested ml_collections ConfigDicts: overrides such as
`--config.grpo.lr=1e-6` work, a misspelt field fails, and `bat_jax.config_validation.
validate_config` checks the enums against the code's registries. A config-file argument follows
big_vision: `--config=configs/tiny.py:smoke` or `--config=configs/bat9b.py:ckpt=/models/x`.
"""

from __future__ import annotations

from typing import Any, Optional

import ml_collections
from ml_collections import config_dict

from bat_jax import sharding


def parse_arg(arg: Optional[str], **defaults: Any) -> ml_collections.ConfigDict:
  """Parses a config-file argument `"a=1,b,c=x"` into typed fields, big_vision style.

  Each key must be one of `defaults`; its value is cast to the default's type. A bare `b` sets
  a bool default to True.

  Raises:
    ValueError: an unknown key or a value that does not cast, naming it.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    key, has_value, raw = item.partition("=")
    if key not in defaults:
      raise ValueError(f"config argument: unknown key {key!r}; expected one of "
                       f"{sorted(defaults)}")
    default = defaults[key]
    if isinstance(default, bool):
      if has_value and raw.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"config argument {key!r}: expected a bool, got {raw!r}")
      out[key] = (raw.lower() in ("true", "1")) if has_value else True
    elif not has_value:
      raise ValueError(f"config argument {key!r} needs a value ({key}=...)")
    else:
      try:
        out[key] = type(default)(raw)
      except ValueError as e:
        raise ValueError(f"config argument {key!r}: cannot read {raw!r} as "
                         f"{type(default).__name__}") from e
  return out


def base_config() -> ml_collections.ConfigDict:
  """The unlocked tree with reference-recipe defaults; configs override and then lock it."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.source = "pretrained"          # scratch | pretrained
  c.model.path = config_dict.placeholder(str)  # local HF checkpoint dir (pretrained)
  c.model.hf_config = ml_collections.ConfigDict()  # HF config.json fields (scratch only)
  # bf16 compute (the release trains in bf16); fp32 master params, because a 2.5e-7 update is
  # below bf16's resolution for weights of order 1e-2 and would round away.
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  # Softmax attention kernel of the trained policy (bat_jax.model.attention.ATTENTION_IMPLS):
  # None picks automatically and would take cuDNN on any GPU, but cuDNN flash attention with
  # Qwen3.5's head_dim 256 needs Hopper (sm90) or newer; set "chunked" (or "xla") on older GPUs.
  c.model.attention_impl = config_dict.placeholder(str)

  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.source = "pretrained"      # pretrained (read from `path`) | train
  c.tokenizer.path = config_dict.placeholder(str)  # defaults to model.path when unset
  c.tokenizer.train = ml_collections.ConfigDict()
  c.tokenizer.train.vocab_size = 4096    # includes the special tokens
  c.tokenizer.train.corpus_tasks = 256   # task instances rendered into the training corpus
  # Tool block of the system message: the chat template's own (Qwen's ~650-token preamble) or
  # `compact` (a few lines; bat_jax.model.compact_chat) for small policies trained from scratch.
  c.tokenizer.tool_preamble = "template"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1                       # -1: all devices left over
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.sharding = ml_collections.ConfigDict()
  # Logical axes (the names bat_jax.model puts on params and activations) -> mesh axes. The
  # default is FSDP on "embed", tensor parallel on vocab / mlp / heads ("tensor" is size 1
  # unless a config raises it); a config overrides the whole tuple.
  c.sharding.rules = sharding.DEFAULT_RULES

  c.distributed = ml_collections.ConfigDict()
  c.distributed.enabled = False          # jax.distributed.initialize() before anything else
  c.distributed.coordinator_address = config_dict.placeholder(str)  # None: auto-detect
  c.distributed.num_processes = config_dict.placeholder(int)
  c.distributed.process_id = config_dict.placeholder(int)
  # JAX's share of GPU memory (XLA_PYTHON_CLIENT_MEM_FRACTION) when SGLang shares the GPUs.
  c.distributed.xla_mem_fraction = config_dict.placeholder(float)

  # The shared trainer (bat_jax.train): dtypes the step uses and what it keeps across rounds.
  c.trainer = ml_collections.ConfigDict()
  # dtype the fp32 master params are cast to (on each shard) before the forward, so FSDP
  # gathers and matmuls move bf16; None: use them as stored.
  c.trainer.weight_dtype = config_dict.placeholder(str)
  # dtype of the frozen KL reference copy (its logprobs come from their own pass); None: as stored.
  c.trainer.reference_dtype = config_dict.placeholder(str)
  # Round artifacts kept (orbax round checkpoints and candidate exports): the last N rounds;
  # the promoted policy's export and the SFT policy are always kept.
  c.trainer.keep_rounds = 2

  # How trainer and rollout server share each accelerator (README "GPU memory layout"; checked by
  # python -m bat_jax.memory_plan). "fraction": fixed split, JAX gets distributed.xla_mem_fraction.
  # "timeshare": the rollout server releases its weights and KV pool around every train step
  # (SGLang /release_memory_occupation, /resume_memory_occupation) and JAX allocates without a
  # pool (XLA_PYTHON_CLIENT_ALLOCATOR=platform), so between steps it holds only params, moments
  # and reference; a step may use all but `rollout_reserved_gib`.
  c.memory = ml_collections.ConfigDict()
  c.memory.layout = "fraction"
  c.memory.device_gib = 80.0
  c.memory.rollout_reserved_gib = 4.0    # timeshare: what a released rollout server still holds

  # Cold-start SFT, run once (release: full parameter, bf16, 8 devices x 1 x 4 accumulation).
  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 200
  c.sft.global_batch_size = 32
  c.sft.micro_batches = 4                # gradient accumulation steps
  c.sft.max_seq_len = 8192
  # Shorter padded lengths: each batch is drawn from one length bucket (bat_jax.sft.sft_dataset)
  # instead of padding every row to the longest; one compiled step per bucket.
  c.sft.bucket_lengths = ()
  c.sft.lr = 2e-5
  c.sft.warmup_steps = 0                 # not in the release
  c.sft.schedule = "constant"            # not in the release
  c.sft.weight_decay = 0.0               # not in the release
  c.sft.max_grad_norm = 1.0              # not in the release
  c.sft.validation_fraction = 0.05
  c.sft.max_validation_examples = 512
  c.sft.num_examples = 6400              # rows drawn from the Stage Bank (steps x batch)
  # Further tasks per grid state giving only each focus's first-action row (nothing executed;
  # bat_jax.stagebank.sft_rows.SftSpec): task diversity for small from-scratch policies.
  c.sft.first_action_tasks = 0
  c.sft.remat = "full"
  c.sft.checkpoint = ml_collections.ConfigDict({"every": 10, "keep": 3})

  # GRPO, one round = steps_per_round updates; evaluation once after each round.
  c.grpo = ml_collections.ConfigDict()
  c.grpo.rounds = 10
  c.grpo.steps_per_round = 50
  c.grpo.prompt_groups = 8               # state_ids per update
  c.grpo.group_size = 4                  # continuations per state_id
  c.grpo.lr = 2.5e-7
  c.grpo.warmup_steps = 0                # not in the release
  c.grpo.schedule = "constant"           # not in the release
  c.grpo.weight_decay = 0.0              # not in the release
  c.grpo.kl_coef = 0.006                 # KL as a loss term, never in the reward
  c.grpo.kl_estimator = "k3"             # not in the release (verl's low_var_kl, clamped as verl)
  # The KL anchor: "sft" (the cold-start SFT policy, every round; verl's reference is the model
  # the RL run started from) or "round_start" (the policy each round starts from). README argues
  # the default.
  c.grpo.kl_reference = "sft"
  c.grpo.loss_agg = "seq-mean-token-mean"
  # seq-mean-token-sum-norm's constant length (denominator = sequences x this; verl's
  # loss_scale_factor). None: rollout.limits.max_response_tokens.
  c.grpo.loss_norm_length = config_dict.placeholder(int)
  c.grpo.advantage = ml_collections.ConfigDict({"mode": "grpo", "std_normalize": False})
  c.grpo.clip_low = 0.2                  # not in the release
  c.grpo.clip_high = 0.2                 # not in the release
  # Dual clip for A < 0: the loss is capped at -A * dual_clip. 3.0 is verl's clip_ratio_c
  # default (always on there); None turns it off. Not in the release.
  c.grpo.dual_clip = config_dict.FieldReference(3.0, field_type=float)
  # Truncated importance sampling: per-token weight min(exp(old_logp - sampler_logp), tis_cap)
  # against sampler/trainer mismatch (verl's tis_imp_ratio_cap; 2.0 is a common value). None: off.
  c.grpo.tis_cap = config_dict.placeholder(float)
  c.grpo.max_grad_norm = 1.0             # not in the release
  c.grpo.micro_batches = 4
  c.grpo.logprob_chunk_size = 512        # sequence chunk of the taken-token logprob scan
  c.grpo.remat = "full"
  c.grpo.checkpoint = ml_collections.ConfigDict({"every": 5, "keep": 3})

  c.rollout = ml_collections.ConfigDict()
  c.rollout.engine = "sglang"            # jax (in process) | sglang (servers + weight sync)
  # Field names follow bat_jax.rollout: SamplingParams (less the per-turn max_new_tokens and
  # stop ids, which the agent loop sets) and RolloutLimits.
  c.rollout.sampling = ml_collections.ConfigDict()
  c.rollout.sampling.temperature = 0.7
  c.rollout.sampling.top_p = 1.0
  c.rollout.sampling.top_k = -1          # -1: off (SGLang's convention)
  c.rollout.limits = ml_collections.ConfigDict()
  c.rollout.limits.max_assistant_turns = 24
  c.rollout.limits.max_tool_calls = 23
  c.rollout.limits.max_response_tokens = 16384   # cumulative over the trajectory
  c.rollout.limits.max_observation_chars = 2048
  c.rollout.limits.max_turn_tokens = 4096        # per assistant turn; not in the release
  c.rollout.limits.max_code_chars = 32768        # per tool call; not in the release
  c.rollout.limits.max_context_tokens = config_dict.placeholder(int)  # None: engine decides
  c.rollout.max_concurrent_trajectories = 32     # one update's worth (8 groups x 4)
  c.rollout.jax = ml_collections.ConfigDict()
  c.rollout.jax.batch_size = 32          # rows decoded together
  c.rollout.jax.max_len = 49152          # KV-cache length: prompt + responses + observations
  c.rollout.jax.prefill_chunk = 512
  c.rollout.sglang = ml_collections.ConfigDict()
  c.rollout.sglang.launch = True         # start servers; False: connect to `urls`
  c.rollout.sglang.urls = ()             # e.g. ("http://host:30000",) when launch is False
  # sglang.launch_server (GPU) | bat_jax.serve (our server over the JAX engine, same flags).
  c.rollout.sglang.server_module = "sglang.launch_server"
  # The server's interpreter: SGLang 0.5.23 needs its own venv (`bash .ci/run --setup-only
  # --gpu` makes .venv-sglang). None: this interpreter (right for bat_jax.serve).
  c.rollout.sglang.python = config_dict.placeholder(str)
  c.rollout.sglang.port = 30000          # 0: any free port
  c.rollout.sglang.dtype = "bfloat16"    # --dtype, and the dtype of the exported weights
  # SGLang 0.5.23: a fraction of the GPU memory FREE when the server starts (after the JAX
  # trainer took distributed.xla_mem_fraction), for weights + KV pool.
  c.rollout.sglang.mem_fraction_static = 0.5
  # Free the server's weights + KV (/release_memory_occupation) for each train step and take
  # them back (/resume_memory_occupation) before the weight sync; adds --enable-memory-saver.
  c.rollout.sglang.release_memory = False
  c.rollout.sglang.tp_size = 1
  c.rollout.sglang.dp_size = 8
  c.rollout.sglang.extra_args = ()       # more launch flags, e.g. ("--num-slots", "8")
  c.rollout.sglang.startup_timeout_s = 900.0
  c.rollout.sglang.request_timeout_s = 600.0
  c.rollout.sglang.max_retries = 5       # connection errors and 5xx, exponential backoff

  c.sandbox = ml_collections.ConfigDict()
  c.sandbox.wall_s = 30.0
  c.sandbox.cpu_s = 20
  c.sandbox.memory_mb = 1024
  c.sandbox.max_procs = 64
  c.sandbox.max_output_bytes = 1 << 20
  c.sandbox.max_workspace_mb = 256

  # Round view: n_batches x (pool rows per batch, curriculum.pool_mix) = 378 x 8 = 3,024 rows.
  c.stagebank = ml_collections.ConfigDict()
  c.stagebank.n_batches = 378
  c.stagebank.seed = 0
  # Tasks synthesised at once (threads) for the cold-start SFT rows: a task's time is mostly
  # sandbox start-up and waits, so this beats the core count.
  c.stagebank.workers = 4
  c.stagebank.mode = "spawn"             # spawn `python -m bat_jax.stagebank serve` | connect
  c.stagebank.dir = config_dict.placeholder(str)  # None: WORKDIR/stagebank
  c.stagebank.request_timeout_s = 3600.0

  # What an action is (both sides: SFT rows, Stage Bank rows, rollouts, held-out cells).
  c.workflow = ml_collections.ConfigDict()
  c.workflow.action_space = "code"       # code (the reference) | stage_tools (workspace CLIs)

  c.evaluator = ml_collections.ConfigDict()
  c.evaluator.kind = "builtin"           # builtin held-out teacher | external argv adapter
  c.evaluator.tier = "lite"              # lite | standard
  c.evaluator.seed = 20260816            # fixes the paired cells
  c.evaluator.cells_per_track = 6        # paired cells per track, fixed by evaluator.seed
  c.evaluator.workers = 8
  c.evaluator.external = ml_collections.ConfigDict()
  # JSON-list-style argv, no shell; placeholders {checkpoint} {request} {output}.
  c.evaluator.external.argv = ()
  c.evaluator.external.timeout_s = 7200.0

  c.curriculum = ml_collections.ConfigDict()
  c.curriculum.mode = "argmin"           # bat_jax.curriculum.MODES
  c.curriculum.temperature = 0.1         # softmin only
  c.curriculum.pool_mix = ml_collections.ConfigDict({"s_target": 4, "s_mix": 2, "e2e": 2})

  c.gate = ml_collections.ConfigDict()
  c.gate.max_overall_drop = 0.01
  c.gate.max_task_drop = 0.03
  c.gate.max_track_drop = 0.05
  c.gate.max_stage_drop = 0.03
  c.gate.guarded_stages = ("S3", "S4", "S5")
  c.gate.catastrophic_overall_drop = 0.20
  c.gate.tolerance = 1e-9                # float-representation slack at the boundaries

  c.logging = ml_collections.ConfigDict()
  c.logging.tensorboard = True
  c.logging.progress = True
  c.logging.log_every_steps = 1
  return c


# Token bounds of one trajectory's parts that are not limits of their own (Qwen chat template):
PROMPT_TOKENS = 4096          # system prompt + tool schema + task brief (Stage Bank prompts)
TURN_OVERHEAD_TOKENS = 24     # <|im_end|>, user/assistant headers, empty think block per turn
OBSERVATION_OVERHEAD_TOKENS = 8  # <tool_response> open/close and newlines per observation


def trajectory_token_cap(limits: ml_collections.ConfigDict) -> int:
  """A context cap that holds a trajectory at every limit at once.

  Response tokens are counted by the rollout (`max_response_tokens`); an observation is clipped
  to `max_observation_chars` characters, and a byte-level BPE never gives more tokens than bytes,
  so ASCII output is at most one token per character; one observation per tool call
  (`max_tool_calls`) and one turn overhead per assistant turn. Rounded up to a multiple of 512
  (the logprob chunk). Longer trajectories end as `context_full`, never truncated.
  """
  tokens = (PROMPT_TOKENS + limits.max_response_tokens
            + limits.max_tool_calls * (limits.max_observation_chars + OBSERVATION_OVERHEAD_TOKENS)
            + limits.max_assistant_turns * TURN_OVERHEAD_TOKENS)
  return -(-tokens // 512) * 512


def reference_gpu_config(arg: Optional[str], default_ckpt: str) -> ml_collections.ConfigDict:
  """BaT-4B/9B: the reference recipe on a local Qwen3.5 checkpoint, 8 GPUs per host.

  Trainer and SGLang share each host's 8 GPUs (8 rollout replicas, TP 1, as in the release), so
  both memory fractions are set. Params, grads and AdamW state are FSDP-sharded over the 8 GPUs
  of a host; `data` spans hosts (jax.distributed). `arg`: `ckpt=DIR` (the local checkpoint,
  tokenizer files included), `hosts=N` (processes for jax.distributed; 1 = single host).
  """
  arg = parse_arg(arg, ckpt=default_ckpt, hosts=1)
  c = base_config()
  c.model.source = "pretrained"
  c.model.path = arg.ckpt
  c.tokenizer.source = "pretrained"
  c.tokenizer.path = arg.ckpt
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 8, 1
  c.distributed.enabled = arg.hosts > 1
  if arg.hosts > 1:
    c.distributed.num_processes = arg.hosts
  c.trainer.weight_dtype = "bfloat16"     # bf16 gathers and matmuls, fp32 master weights
  c.trainer.reference_dtype = "bfloat16"  # the frozen KL reference
  c.rollout.limits.max_context_tokens = trajectory_token_cap(c.rollout.limits)
  c.rollout.jax.max_len = c.rollout.limits.max_context_tokens
  # One 8x80 GB node, time-shared (README "GPU memory layout"): SGLang releases its weights and
  # KV pool around every train step; JAX keeps no pool, so between steps it holds only params,
  # moments and the bf16 reference (14.6 GiB per GPU at 9B), and SGLang's static share (60% of
  # the GPU, taken at start-up while JAX holds nothing) fits beside them.
  c.memory.layout = "timeshare"
  c.memory.device_gib = 80.0
  c.memory.rollout_reserved_gib = 4.0
  c.distributed.xla_mem_fraction = None
  c.rollout.engine = "sglang"
  c.rollout.sglang.python = ".venv-sglang/bin/python"
  c.rollout.sglang.release_memory = True  # timeshare: weights + KV pool freed around each train step
  c.rollout.sglang.mem_fraction_static = 0.6
  c.rollout.sglang.tp_size = 1
  c.rollout.sglang.dp_size = 8
  c.lock()
  return c


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
  """The bare reference tree (no model path): use bat4b.py / bat9b.py / tiny.py to run."""
  del arg
  config = base_config()
  config.lock()
  return config
