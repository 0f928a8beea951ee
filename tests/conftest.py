"""Shared test fixtures. Tests mirror the package layout and build tiny fixtures themselves."""

import os
import shutil
import tempfile

import pytest

# Tests run on CPU; fake devices let sharding tests build 8-device meshes. The suite compiles
# hundreds of tiny programs and is compile-bound (tests/model, train and grpo: 172 s cold, 70 s
# with every program already in the XLA cache). LLVM's optimisation of their machine code is
# ~40% of the compile CPU and buys nothing at these sizes (matmuls still go to the CPU's dot
# library; memory analyses are fixed before LLVM runs). XLA:CPU's legacy fusion codegen
# compiles the tiny SFT step ~1.3x faster and runs it ~1.4x slower (perf/suite_compile.py),
# which the suite gains back many times (814 -> 558 s). Subprocesses inherit the flags.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Dense causal attention unrolls its query blocks into the program: 2 instead of 8 keeps the
# suite's compiles short (subprocesses inherit it); test_attention.py passes 1, 3 and 8 itself.
os.environ.setdefault("BAT_JAX_CAUSAL_QUERY_BLOCKS", "2")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One persistent XLA cache for the whole run, shared by both xdist workers and every subprocess
# they start (the env is inherited): hundreds of tests build the same tiny models and steps, and
# a program compiled once is then read back (keyed by its HLO and flags, so nothing is skipped).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"bat_jax_test_xla_{_RUN}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
# The tiny base's cache (configs/base.py `pretrain.cache_dir`): one per test session, never the
# user's ~/.cache; a smoke base built by one test is reused by the next.
os.environ["BAT_JAX_CACHE"] = tempfile.mkdtemp(prefix="bat_jax_cache_")


def _has_gpu() -> bool:
  try:
    import jax
    return any(d.platform == "gpu" for d in jax.devices())
  except Exception:  # pragma: no cover - no GPU backend installed
    return False


def pytest_collection_modifyitems(config, items):
  gpu = None
  for item in items:
    if "gpu" in item.keywords:
      if gpu is None:
        gpu = _has_gpu()
      if not gpu:
        item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def require_bwrap():
  if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")


# A tiny chat tokenizer shared by the rollout and serve tests (trained once per session; a
# package's own fixture of the same name overrides it, e.g. tests/model's larger one).
@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
  # deferred: most tests never need transformers
  from bat_jax.model import tokenizer as tk
  from bat_jax.model import tokenizer_corpus
  return tk.train_tokenizer(tokenizer_corpus.tiny_corpus(num_docs=120), 600,
                            tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
  from bat_jax.model import tokenizer as tk
  return tk.load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def chat(tokenizer):
  from bat_jax.model import chat_format
  return chat_format.ChatFormat.for_model("qwen3_5_text", tokenizer)
