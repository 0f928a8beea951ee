"""The base's builder record: CPU model and vector extensions from /proc/cpuinfo."""

import platform

from bat_jax.pretrain.host import ISA_FLAGS, host_record

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx fma avx2 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx fma avx2 sha_ni avx512f
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes
"""


def test_the_first_cpus_model_and_vector_extensions_are_recorded(tmp_path):
  (tmp_path / "x86").write_text(X86)
  record = host_record(tmp_path / "x86")
  assert record["cpu"] == "AMD EPYC 7B13"
  assert record["isa"] == ["avx2", "fma"]   # the first CPU's flags, in ISA_FLAGS order
  assert record["machine"] == platform.machine() and record["cores"] >= 1
  assert record["jax"] and record["jaxlib"]  # installed here
  (tmp_path / "arm").write_text(ARM)
  assert host_record(tmp_path / "arm")["isa"] == ["asimd"]
  assert set(ISA_FLAGS) >= {"avx512f", "avx2", "fma"}


def test_a_host_without_cpuinfo_still_gets_a_record(tmp_path):
  record = host_record(tmp_path / "missing")
  assert record["isa"] == [] and record["cpu"] == platform.processor()
