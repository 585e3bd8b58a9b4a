"""k3.cpuinfo.parse on /proc/cpuinfo texts of an Intel, an AMD and an ARM machine."""

from __future__ import annotations

from k3.cpuinfo import cpuinfo, parse

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: Intel(R) Xeon(R) Processor
physical id\t: 0
core id\t: 0
flags\t\t: fpu avx2 fma avx512f avx512bw

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
physical id\t: 0
core id\t: 1
flags\t\t: fpu avx2 fma avx512f avx512bw
"""

AMD = INTEL.replace("GenuineIntel", "AuthenticAMD").replace("Intel(R) Xeon(R) Processor", "AMD EPYC 9R14") \
    .replace("core id\t: 1", "core id\t: 0")          # two threads of one core

ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
"""


def test_intel():
    i = parse(INTEL)
    assert (i.model, i.vendor, i.physical) == ("Intel(R) Xeon(R) Processor", "intel", 2)
    assert {"avx2", "fma", "avx512f", "avx512bw"} <= i.flags and "sve" not in i.flags


def test_amd_counts_cores_not_threads():
    i = parse(AMD)
    assert (i.model, i.vendor, i.physical) == ("AMD EPYC 9R14", "amd", 1)


def test_arm_and_empty():
    a = parse(ARM)
    assert a.vendor == "" and "asimd" in a.flags and a.physical is None and a.model
    e = parse("")
    assert e.vendor == "" and e.flags == frozenset() and e.physical is None and e.model


def test_this_machine_is_read_once():
    assert cpuinfo() is cpuinfo()
