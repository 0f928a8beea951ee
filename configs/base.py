r"""The shared config tree, with the BaT reference recipe as its defaults.

Every config (`tiny.py`, `bat4b.py`, `bat9b.py`) starts from `base_config()` and overrides only
what differs. The recipe values come from the public BaT release (its
bat-reference.json, bundled as tests/configs/bat-reference.json and checked there); values the
release does not state are marked "not in the release" and are this project's choice.

Configs are locked, nested ml_collections ConfigDicts: overrides such as
`--config.grpo.lr=1e-6` work, a misspelt field fails, and `bat_jax.config_validation.
validate_config` checks the enums against the code's registries. A config-file argument follows
big_vision: `--config=configs/tiny.py:smoke` or `--config=configs/bat9b.py:ckpt=/models/x`.
"""

from __future__ import annotations

import os

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


def model_config() -> ml_collections.ConfigDict:
  """The policy: where it comes from and its dtypes."""
  s = ml_collections.ConfigDict()
  # scratch (random init) | tiny_base (random init, then pretrained here on the generated corpus:
  # `pretrain`) | pretrained (any local HF checkpoint at `path`)
  s.source = "pretrained"
  s.path = config_dict.placeholder(str)  # local HF checkpoint dir (pretrained)
  s.hf_config = ml_collections.ConfigDict()  # HF config.json fields (scratch, tiny_base)
  # bf16 compute (the release trains in bf16); fp32 master params, because a 2.5e-7 update is
  # below bf16's resolution for weights of order 1e-2 and would round away.
  s.dtype = "bfloat16"
  s.param_dtype = "float32"
  # Softmax attention kernel of the trained policy (bat_jax.model.attention.ATTENTION_IMPLS):
  # None picks automatically and would take cuDNN on any GPU, but cuDNN flash attention with
  # Qwen3.5's head_dim 256 needs Hopper (sm90) or newer; set "chunked" (or "xla") on older GPUs.
  s.attention_impl = config_dict.placeholder(str)
  return s


def tokenizer_config() -> ml_collections.ConfigDict:
  """The tokenizer: pretrained or trained locally, and the system message's tool block."""
  s = ml_collections.ConfigDict()
  s.source = "pretrained"      # pretrained (read from `path`) | train
  s.path = config_dict.placeholder(str)  # defaults to model.path when unset
  s.train = ml_collections.ConfigDict()
  s.train.vocab_size = 4096    # includes the special tokens
  s.train.corpus_tasks = 256   # task instances rendered into the training corpus
  # Which task instances: not the run's `seed`, so every run seed gets the same vocabulary and
  # with it the same tiny base (its cache key hashes the tokenizer), as `pretrain.seed` intends.
  s.train.seed = 0
  # Tool block of the system message: the chat template's own (Qwen's ~650-token preamble) or
  # `compact` (a few lines; bat_jax.model.compact_chat) for small policies trained from scratch.
  s.tool_preamble = "template"
  return s


def pretrain_config() -> ml_collections.ConfigDict:
  """The tiny base's pretraining (`model.source = "tiny_base"`; bat_jax.pretrain)."""
  s = ml_collections.ConfigDict()
  # Echoes only first, short lists then longer ones, at a held learning rate, then the corpus
  # with a cosine decay (experiments/README.md, "The tiny base").
  # Short rows of short echoes (lists of 2-6): on copy_reference.py's rows the copying plateau
  # ended by step ~80 (lists of 4-13 in 64-token rows: ~150; in 256-token rows: 250-350).
  s.echo_steps = 100
  s.echo_batch_size = 64
  s.echo_seq_len = 32            # >= the longest echo of its phase (build_corpus checks)
  s.echo_long_steps = 150        # then lists of 4-13 in 64-token rows (the same tokens per step)
  s.echo_long_batch_size = 32
  s.echo_long_seq_len = 64
  # Copy accuracy exact (values): 300 steps 0.031 (0.150), 600 0.156 (0.573), 900 0.406 (0.812);
  # on the 900-step base the main job's held-out S2/S3 leave 0 (experiments/README.md). 700
  # since the extension phase (below) goes on with the next documents: the main job's 15 min.
  s.steps = 700
  s.batch_size = 16
  s.seq_len = 256                # packed plain-text documents, next-token loss on every token
  s.lr = 3e-3
  s.warmup_steps = 20
  # Context extension: the next documents packed into rows as long as a task's episode. Trained
  # on 256-token rows alone the base copied none of its probes after 500 tokens of other
  # documents (`probe_depth`); 150 steps at 1,024 took that to 0.75 in ~100 s
  # (experiments/README.md, "Context extension").
  s.extend_steps = 150
  s.extend_batch_size = 4
  s.extend_seq_len = 1024
  s.extend_lr = 1e-3
  s.seed = 0                     # the corpus and the init: one base for every run seed
  s.probes = 96                  # fresh documents whose target call the report scores
  # ... scored again after this many tokens of other documents (0: not): where a task's
  # episode makes its calls (400-1,150 tokens in), not where a short corpus row ends.
  s.probe_depth = 768
  s.checkpoint_every = 100
  # One folder per hash of (generator, these fields, hf_config, tokenizer): shared by runs.
  # $BAT_JAX_CACHE (default ~/.cache/bat_jax) is read here, so the test suite points it at a
  # temporary folder and never touches the user's cache.
  s.cache_dir = os.path.join(os.environ.get("BAT_JAX_CACHE", "~/.cache/bat_jax"), "tiny_base")
  return s


def mesh_config() -> ml_collections.ConfigDict:
  """Device mesh axis sizes."""
  s = ml_collections.ConfigDict()
  s.data = -1                       # -1: all devices left over
  s.fsdp = 1
  s.tensor = 1
  return s


def sharding_config() -> ml_collections.ConfigDict:
  """Logical-axis to mesh-axis rules."""
  s = ml_collections.ConfigDict()
  # Logical axes (the names bat_jax.model puts on params and activations) -> mesh axes. The
  # default is FSDP on "embed", tensor parallel on vocab / mlp / heads ("tensor" is size 1
  # unless a config raises it); a config overrides the whole tuple.
  s.rules = sharding.DEFAULT_RULES
  return s


def distributed_config() -> ml_collections.ConfigDict:
  """Multi-process JAX (jax.distributed) and its share of GPU memory."""
  s = ml_collections.ConfigDict()
  s.enabled = False          # jax.distributed.initialize() before anything else
  s.coordinator_address = config_dict.placeholder(str)  # None: auto-detect
  s.num_processes = config_dict.placeholder(int)
  s.process_id = config_dict.placeholder(int)
  # JAX's share of GPU memory (XLA_PYTHON_CLIENT_MEM_FRACTION) when SGLang shares the GPUs.
  s.xla_mem_fraction = config_dict.placeholder(float)
  return s


def trainer_config() -> ml_collections.ConfigDict:
  """The shared trainer (bat_jax.train): dtypes the step uses and what it keeps across rounds."""
  s = ml_collections.ConfigDict()
  # dtype the fp32 master params are cast to (on each shard) before the forward, so FSDP
  # gathers and matmuls move bf16; None: use them as stored.
  s.weight_dtype = config_dict.placeholder(str)
  # dtype of the frozen KL reference copy (its logprobs come from their own pass); None: as stored.
  s.reference_dtype = config_dict.placeholder(str)
  # Round artifacts kept (orbax round checkpoints and candidate exports): the last N rounds;
  # the promoted policy's export and the SFT policy are always kept.
  s.keep_rounds = 2
  return s


def memory_config() -> ml_collections.ConfigDict:
  """How trainer and rollout server share each accelerator."""
  # How trainer and rollout server share each accelerator (README "GPU memory layout"; checked by
  # python -m bat_jax.memory_plan). "fraction": fixed split, JAX gets distributed.xla_mem_fraction.
  # "timeshare": the rollout server releases its weights and KV pool around every train step
  # (SGLang /release_memory_occupation, /resume_memory_occupation) and JAX allocates without a
  # pool (XLA_PYTHON_CLIENT_ALLOCATOR=platform), so between steps it holds only params, moments
  # and reference; a step may use all but `rollout_reserved_gib`.
  s = ml_collections.ConfigDict()
  s.layout = "fraction"
  # What the card reports, not its marketing size: an "80 GB" H100 / A100 shows ~79.6 GiB
  # (nvidia-smi memory.total; jax: memory_stats()["bytes_limit"] / mem fraction).
  s.device_gib = 79.6
  s.rollout_reserved_gib = 4.0    # what a rollout server holds beyond its static share (its
                                  # CUDA / NCCL context, CUDA graphs; all it keeps when released)
  s.jax_context_gib = 1.5         # JAX's CUDA context, cuBLAS / cuDNN workspaces, NCCL buffers
  s.rollout_activation_gib = 2.0  # the serving server's activations (within its 1 - fraction)
  s.headroom_gib = 4.0            # memory_plan: every phase must leave this much free
  return s


def sft_config() -> ml_collections.ConfigDict:
  """Cold-start SFT, run once (release: full parameter, bf16, 8 devices x 1 x 4 accumulation)."""
  s = ml_collections.ConfigDict()
  s.steps = 200
  s.global_batch_size = 32
  s.micro_batches = 4                # gradient accumulation steps
  s.max_seq_len = 8192
  # Shorter padded lengths: each batch is drawn from one length bucket (bat_jax.sft.sft_dataset)
  # instead of padding every row to the longest; one compiled step per bucket.
  s.bucket_lengths = ()
  s.lr = 2e-5
  s.warmup_steps = 0                 # not in the release
  s.schedule = "constant"            # not in the release
  s.weight_decay = 0.0               # not in the release
  s.max_grad_norm = 1.0              # not in the release
  s.adam_eps = 1e-8                  # AdamW's epsilon (optax's default)
  s.validation_fraction = 0.05
  s.max_validation_examples = 512
  s.num_examples = 6400              # rows drawn from the Stage Bank (steps x batch)
  # Further tasks per grid state giving only each focus's first-action row (nothing executed;
  # bat_jax.stagebank.sft_rows.SftSpec): task diversity for small from-scratch policies.
  s.first_action_tasks = 0
  # Further tasks per (track, outcome) giving their whole E2E episode's rows (every action after
  # the real history; bat_jax.stagebank.sft_rows.SftSpec): the mid-episode contexts that
  # stage-local rows never show.
  s.e2e_tasks = 0
  # Each executed focus also gives the row after its last call, whose target is a final turn
  # with no tool call (bat_jax.stagebank.sft_rows.STOP_TEXT): the policy learns to end an
  # episode instead of calling on to the turn limit.
  s.stop_rows = False
  # With `stop_rows`, also after the last call of a stage-local focus before S5 (False: only
  # where the workflow ends, after E2E and S5). There an E2E episode goes on to the next stage,
  # so a stop row teaches the opposite of the E2E rows at the same observation.
  s.stage_stop_rows = True
  # Further tasks per (track, outcome) giving the rows of their E2E episode after validation:
  # the reaction to what it printed, and every call after (sft_rows.SftSpec).
  s.reaction_tasks = 0
  # Repeats train rows of rare decisions (bat_jax.stagebank.sft_rows.decision_kind) so a kind of
  # n rows is drawn in proportion to n ** (1 - this): 0 draws rows as built, 1 every decision
  # about equally (not in the release; bat_jax.sft.balanced_repeats).
  s.decision_balance = 0.0
  s.remat = "full"
  s.checkpoint = ml_collections.ConfigDict({"every": 10, "keep": 3})
  # > 0 adds a next-token loss on the context (prompt, earlier turns, observations) at this
  # weight to the target action's (bat_jax.sft.sft_loss_fn); not in the release.
  s.context_loss_weight = 0.0
  return s


def grpo_config() -> ml_collections.ConfigDict:
  """GRPO, one round = steps_per_round updates; evaluation once after each round."""
  s = ml_collections.ConfigDict()
  s.rounds = 10
  s.steps_per_round = 50
  s.prompt_groups = 8               # state_ids per update
  s.group_size = 4                  # continuations per state_id
  s.lr = 2.5e-7
  s.warmup_steps = 0                # not in the release
  s.schedule = "constant"           # not in the release
  s.weight_decay = 0.0              # not in the release
  s.kl_coef = 0.006                 # KL as a loss term, never in the reward
  # Reward subtracted per failed tool call or malformed turn before the advantages (not in the
  # release: 0 keeps BaT's rubric-only reward; an ablation, off in every config).
  s.failed_call_penalty = 0.0
  # False leaves the closing stop turn of stage-local rows out of the loss: the row was cut at
  # a stage boundary, and an E2E episode asks for the next call at the same observation (not
  # in the release; an ablation, True in every config).
  s.train_stage_stop = True
  s.kl_estimator = "k3"             # not in the release (verl's low_var_kl, clamped as verl)
  # The KL anchor: "sft" (the cold-start SFT policy, every round; verl's reference is the model
  # the RL run started from) or "round_start" (the policy each round starts from). README argues
  # the default.
  s.kl_reference = "sft"
  # The ratio's old logprobs: "step", the update's own logprobs under stop_gradient (exact here:
  # each rollout batch makes one optimizer update, so the params that would score old_logp are
  # the params being updated; the ratio is 1 and the gradient verl's), or "pass", a separate
  # forward first as verl's compute_log_prob (one more forward per step; it also logs
  # sampler_gap on steps without signal).
  s.old_logp = "step"
  s.loss_agg = "seq-mean-token-mean"
  # seq-mean-token-sum-norm's constant length (denominator = sequences x this; verl's
  # loss_scale_factor). None: rollout.limits.max_response_tokens.
  s.loss_norm_length = config_dict.placeholder(int)
  # `credit`: "outcome" (the release: one advantage per sequence) or "stage" (not in the
  # release): each turn of an E2E episode is credited with its stage's group-relative reward and
  # the later stages' at `credit_discount` per stage (bat_jax.grpo.advantages.stage_credit; 1 is
  # DeepSeekMath's process-reward GRPO, 0 its own stage only). Stage-local rows are unchanged.
  # `mode`: grpo | rloo | placebo (a control: GRPO's advantages shuffled within each group, so a
  # round's update keeps its size and loses its signal; bat_jax.grpo.advantages).
  s.advantage = ml_collections.ConfigDict({"mode": "grpo", "std_normalize": False,
                                           "credit": "outcome", "credit_discount": 1.0})
  s.clip_low = 0.2                  # not in the release
  s.clip_high = 0.2                 # not in the release
  # Dual clip for A < 0: the loss is capped at -A * dual_clip. 3.0 is verl's clip_ratio_c
  # default (always on there); None turns it off. Not in the release.
  s.dual_clip = config_dict.FieldReference(3.0, field_type=float)
  # Truncated importance sampling: per-token weight min(exp(old_logp - sampler_logp), tis_cap)
  # against sampler/trainer mismatch (verl's tis_imp_ratio_cap; 2.0 is a common value). None: off.
  s.tis_cap = config_dict.placeholder(float)
  s.max_grad_norm = 1.0             # not in the release
  # Policy gradient only on tokens whose policy entropy (nats, at the rollout temperature) is at
  # least this; the KL term keeps every token. 0: every token (the release). Not in the release:
  # Wang et al. 2025 ("Beyond the 80/20 rule") train on the ~20% highest-entropy tokens only.
  s.pg_min_entropy = 0.0
  # Advantage reweighting: each token's policy gradient times alpha * p_old + 1 - alpha, so the
  # rare tokens a temperature-1 rollout samples stop dominating the update (Yang et al. 2025).
  # 0: the release's loss. Not in the release.
  s.pg_prob_weight = 0.0
  # AdamW's epsilon. At 1e-8 Adam's first steps move every weight by ~lr whatever its gradient's
  # size; an epsilon near the gradients' scale moves weights with small (noisy) gradients less.
  s.adam_eps = 1e-8
  s.micro_batches = 4
  s.logprob_chunk_size = 512        # sequence chunk of the taken-token logprob scan
  s.logprob_save_probs = False      # True keeps B*T*V fp32 softmax (small vocab only)
  s.remat = "full"
  s.checkpoint = ml_collections.ConfigDict({"every": 5, "keep": 3})
  return s


def rollout_config() -> ml_collections.ConfigDict:
  """Rollouts: engine, sampling, per-trajectory limits and the engines' settings."""
  s = ml_collections.ConfigDict()
  s.engine = "sglang"            # jax (in process) | sglang (servers + weight sync)
  # Field names follow bat_jax.rollout: SamplingParams (less the per-turn max_new_tokens and
  # stop ids, which the agent loop sets) and RolloutLimits.
  s.sampling = ml_collections.ConfigDict()
  s.sampling.temperature = 0.7
  s.sampling.top_p = 1.0
  s.sampling.top_k = -1          # -1: off (SGLang's convention)
  s.limits = ml_collections.ConfigDict()
  s.limits.max_assistant_turns = 24
  s.limits.max_tool_calls = 23
  s.limits.max_response_tokens = 16384   # cumulative over the trajectory
  s.limits.max_observation_chars = 2048
  s.limits.max_turn_tokens = 4096        # per assistant turn; not in the release
  s.limits.max_code_chars = 32768        # per tool call; not in the release
  s.limits.max_context_tokens = config_dict.placeholder(int)  # None: engine decides
  s.max_concurrent_trajectories = 32     # one update's worth (8 groups x 4)
  # A stage-local row ends where its stage does: a call of a later stage's command ends the
  # trajectory unrun (`stage_end`) instead of the policy having to stop there (stage-tools
  # action space only, whose calls name their stage).
  s.stage_end = False
  s.jax = ml_collections.ConfigDict()
  s.jax.batch_size = 32          # rows decoded together
  s.jax.max_len = 49152          # KV-cache length: prompt + responses + observations
  s.jax.prefill_chunk = 512
  s.sglang = ml_collections.ConfigDict()
  s.sglang.launch = True         # start servers; False: connect to `urls`
  s.sglang.urls = ()             # e.g. ("http://host:30000",) when launch is False
  # sglang.launch_server (GPU) | bat_jax.serve (our server over the JAX engine, same flags).
  s.sglang.server_module = "sglang.launch_server"
  # The server's interpreter: SGLang 0.5.23 needs its own venv (`bash .ci/run --setup-only
  # --gpu` makes .venv-sglang). None: this interpreter (right for bat_jax.serve).
  s.sglang.python = config_dict.placeholder(str)
  s.sglang.port = 30000          # 0: any free port
  s.sglang.dtype = "bfloat16"    # --dtype, and the dtype of the exported weights
  # Where each step's weight sync goes (the servers read it by path: on the same host as
  # process 0 unless shared). None: <workdir>/sglang_weights. A tmpfs such as /dev/shm/<run>
  # skips the disk, when it has room for two versions (the old one is removed after the swap;
  # the server refuses to start otherwise, naming this field). Sync exports never fsync.
  s.sglang.export_dir = config_dict.placeholder(str)
  # Weight-sync threads (files written at once, shards cast at once), capped at usable CPUs.
  s.sglang.export_threads = 4
  # SGLang 0.5.23: a fraction of the GPU memory FREE when the server starts (after the JAX
  # trainer took distributed.xla_mem_fraction), for weights + KV pool.
  s.sglang.mem_fraction_static = 0.5
  # Free the server's weights + KV (/release_memory_occupation) for each train step and take
  # them back (/resume_memory_occupation) before the weight sync; adds --enable-memory-saver.
  s.sglang.release_memory = False
  s.sglang.release_timeout_s = 120.0  # until the released memory shows as free on the GPUs
  s.sglang.tp_size = 1
  s.sglang.dp_size = 8
  s.sglang.extra_args = ()       # more launch flags, e.g. ("--num-slots", "8")
  s.sglang.startup_timeout_s = 900.0
  s.sglang.request_timeout_s = 600.0
  s.sglang.max_retries = 5       # connection errors and 5xx, exponential backoff
  return s


def sandbox_config() -> ml_collections.ConfigDict:
  """Per-tool-call sandbox limits (bat_jax.sandbox.SandboxLimits)."""
  s = ml_collections.ConfigDict()
  s.wall_s = 30.0
  s.cpu_s = 20
  s.memory_mb = 1024
  s.max_procs = 64
  s.max_output_bytes = 1 << 20
  s.max_workspace_mb = 256
  return s


def stagebank_config() -> ml_collections.ConfigDict:
  """The Stage Bank: round view size, seed and how the outer loop reaches it."""
  # Round view: n_batches x (pool rows per batch, curriculum.pool_mix) = 378 x 8 = 3,024 rows.
  s = ml_collections.ConfigDict()
  s.n_batches = 378
  s.seed = 0
  # Tasks synthesised at once (threads) for the cold-start SFT rows: a task's time is mostly
  # sandbox start-up and waits, so this beats the core count.
  s.workers = 4
  s.mode = "spawn"             # spawn `python -m bat_jax.stagebank serve` | connect
  s.dir = config_dict.placeholder(str)  # None: WORKDIR/stagebank
  s.request_timeout_s = 3600.0
  return s


def workflow_config() -> ml_collections.ConfigDict:
  """What an action is (both sides: SFT rows, Stage Bank rows, rollouts, held-out cells)."""
  s = ml_collections.ConfigDict()
  s.action_space = "code"       # code (the reference) | stage_tools (workspace CLIs)
  return s


def evaluator_config() -> ml_collections.ConfigDict:
  """The held-out evaluator: kind, tier and the paired cells."""
  s = ml_collections.ConfigDict()
  s.kind = "builtin"           # builtin held-out teacher | external argv adapter
  s.tier = "lite"              # lite | standard
  s.seed = 20260816            # fixes the paired cells
  s.cells_per_track = 6        # paired cells per track, fixed by evaluator.seed
  # Held-back cells per track (evaluator.seed + 1; 0: none): after the last round the SFT and
  # the accepted policy are scored on cells no gate decision or curriculum target has seen, so
  # their difference carries no selection by the gate. Built-in evaluator only; not in the
  # release (its benchmark is the teacher, and its gains are measured on the same cells).
  s.heldback_cells_per_track = 0
  s.workers = 8
  s.external = ml_collections.ConfigDict()
  # JSON-list-style argv, no shell; placeholders {checkpoint} {request} {output}.
  s.external.argv = ()
  s.external.timeout_s = 7200.0
  return s


def curriculum_config() -> ml_collections.ConfigDict:
  """The curriculum's mode and pool mix (bat_jax.curriculum.CurriculumConfig)."""
  s = ml_collections.ConfigDict()
  s.mode = "argmin"           # bat_jax.curriculum.MODES
  s.temperature = 0.1         # softmin only
  s.pool_mix = ml_collections.ConfigDict({"s_target": 4, "s_mix": 2, "e2e": 2})
  return s


def gate_config() -> ml_collections.ConfigDict:
  """Promotion gate thresholds (bat_jax.gate.GateThresholds)."""
  s = ml_collections.ConfigDict()
  s.max_overall_drop = 0.01
  s.max_task_drop = 0.03
  s.max_track_drop = 0.05
  s.max_stage_drop = 0.03
  s.guarded_stages = ("S3", "S4", "S5")
  s.catastrophic_overall_drop = 0.20
  s.tolerance = 1e-9                # float-representation slack at the boundaries
  # 0 = the reference's plain per-track limit; z > 0 widens it by z paired standard errors of
  # the track's per-cell differences (bat_jax.gate), for tracks of a few cells.
  s.track_noise_z = 0.0
  return s


def logging_config() -> ml_collections.ConfigDict:
  """TensorBoard, progress bars and how often to log."""
  s = ml_collections.ConfigDict()
  s.tensorboard = True
  s.progress = True
  s.log_every_steps = 1
  return s


def base_config() -> ml_collections.ConfigDict:
  """The unlocked tree with reference-recipe defaults; configs override and then lock it."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = model_config()
  c.tokenizer = tokenizer_config()
  c.pretrain = pretrain_config()
  c.mesh = mesh_config()
  c.sharding = sharding_config()
  c.distributed = distributed_config()
  c.trainer = trainer_config()
  c.memory = memory_config()
  c.sft = sft_config()
  c.grpo = grpo_config()
  c.rollout = rollout_config()
  c.sandbox = sandbox_config()
  c.stagebank = stagebank_config()
  c.workflow = workflow_config()
  c.evaluator = evaluator_config()
  c.curriculum = curriculum_config()
  c.gate = gate_config()
  c.logging = logging_config()
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


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
  """The bare reference tree (no model path): use bat4b.py / bat9b.py / tiny.py to run."""
  del arg
  config = base_config()
  config.lock()
  return config
