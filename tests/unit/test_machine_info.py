"""benchmarks/common: the CPU description every benchmark JSON carries, from /proc/cpuinfo."""

from __future__ import annotations

from benchmarks.common import ISA_FLAGS, cpu_description, machine_info

# Two processor entries each, as Linux lists them (trimmed to the fields read and a few more).
XEON_AMX = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
stepping\t: 8
flags\t\t: fpu vme sse sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 \
avx512_vnni avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8 arch_capabilities

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
stepping\t: 8
flags\t\t: fpu vme sse sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 \
avx512_vnni avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8 arch_capabilities
"""

EPYC_ZEN4 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx fma avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512_bf16 \
avx512vbmi avx512_vnni avx512_bitalg avx512_vpopcntdq

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx fma avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512_bf16 \
avx512vbmi avx512_vnni avx512_bitalg avx512_vpopcntdq
"""

EPYC_ZEN3 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
stepping\t: 0
flags\t\t: fpu sse2 avx f16c fma avx2 bmi1 bmi2 sha_ni vaes vpclmulqdq
"""


def _flags_set(description: dict) -> set[str]:
    return {flag for flag, present in description["isa"].items() if present}


def test_xeon_with_amx():
    d = cpu_description(XEON_AMX)
    assert d["cpu"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert d["cpu_id"] == {"vendor": "GenuineIntel", "family": 6, "model": 143, "stepping": 8}
    assert _flags_set(d) == set(ISA_FLAGS)  # every listed extension, AMX included


def test_epyc_zen4_has_avx512_bf16_and_vnni_but_no_amx():
    d = cpu_description(EPYC_ZEN4)
    assert d["cpu"] == "AMD EPYC"  # a hypervisor's short name: the numbers say Zen 4
    assert d["cpu_id"] == {"vendor": "AuthenticAMD", "family": 25, "model": 17, "stepping": 1}
    assert _flags_set(d) == {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}


def test_epyc_zen3_is_avx2_only():
    d = cpu_description(EPYC_ZEN3)
    assert d["cpu"] == "AMD EPYC 7B13" and d["cpu_id"]["model"] == 1
    assert _flags_set(d) == {"avx2", "fma"}


def test_a_text_without_cpu_fields_is_unknown():
    d = cpu_description("")
    assert d["cpu"] == "unknown"
    assert d["cpu_id"] == {"vendor": None, "family": None, "model": None, "stepping": None}
    assert not any(d["isa"].values())


def test_machine_info_carries_the_cpu_and_the_threads():
    info = machine_info()
    for key in ("cpu", "cpu_id", "isa", "logical_cpus", "torch_threads", "torch", "date"):
        assert key in info
    assert set(info["isa"]) == set(ISA_FLAGS) and all(isinstance(v, bool) for v in info["isa"].values())
    assert info["logical_cpus"] >= 1 and info["torch_threads"] >= 1
