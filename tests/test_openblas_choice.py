"""Which OpenBLAS kernels mlxvlm names on an x86 CPU (mlxvlm/cpu/openblas_cores.py, mlxvlm/cpu/blas.py).

OpenBLAS releases older than a CPU fall back to older kernels on it: SSE3 on Intel Xeons
they do not know, AVX2 on AMD CPUs with AVX-512. mlxvlm names the best kernels the CPU's
flags allow and the OpenBLAS build accepts, only when OpenBLAS's own pick is in a lower
instruction set, never over the user's OPENBLAS_CORETYPE. The flag lines below are as
Linux shows them on each CPU (the first CPU's `flags` line of /proc/cpuinfo; the Arm one
has `Features` instead), so none of these tests depends on the CPU it runs on; the last
ones load the real OpenBLAS in child processes and skip where there is none.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from mlxvlm.cpu import openblas_cores

# Intel Xeon Platinum 8480+ (Sapphire Rapids, family 6 model 143).
SAPPHIRE_RAPIDS = (
    "GenuineIntel",
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi "
    "mmx fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon "
    "pebs bts rep_good nopl xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq "
    "dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 "
    "x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch "
    "cpuid_fault epb cat_l3 cat_l2 cdp_l3 invpcid_single intel_ppin cdp_l2 ssbd mba ibrs ibpb "
    "stibp ibrs_enhanced tpr_shadow vnmi flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 "
    "avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap avx512ifma "
    "clflushopt clwb intel_pt avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves "
    "cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local split_lock_detect avx_vnni avx512_bf16 "
    "wbnoinvd dtherm ida arat pln pts hwp hwp_act_window hwp_epp hwp_pkg_req avx512vbmi umip "
    "pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme "
    "avx512_vpopcntdq la57 rdpid bus_lock_detect cldemote movdiri movdir64b enqcmd fsrm "
    "md_clear serialize tsxldtrk pconfig arch_lbr amx_bf16 avx512_fp16 amx_tile amx_int8 "
    "flush_l1d arch_capabilities",
)
# Intel Xeon 6972P (Granite Rapids, family 6 model 173).
GRANITE_RAPIDS = (
    "GenuineIntel",
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi "
    "mmx fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon "
    "pebs bts rep_good nopl xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq "
    "dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 "
    "x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch "
    "cpuid_fault epb cat_l3 cat_l2 cdp_l3 intel_ppin cdp_l2 ssbd mba ibrs ibpb stibp "
    "ibrs_enhanced tpr_shadow flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 avx2 smep "
    "bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb "
    "intel_pt avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc "
    "cqm_occup_llc cqm_mbm_total cqm_mbm_local split_lock_detect avx_vnni avx512_bf16 wbnoinvd "
    "dtherm ida arat pln pts hwp hwp_act_window hwp_epp hwp_pkg_req hfi vnmi avx512vbmi umip pku "
    "ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme "
    "avx512_vpopcntdq la57 rdpid bus_lock_detect cldemote movdiri movdir64b enqcmd fsrm "
    "md_clear serialize tsxldtrk pconfig arch_lbr ibt amx_bf16 avx512_fp16 amx_tile amx_int8 "
    "flush_l1d arch_capabilities",
)
# Intel Xeon Platinum 8375C (Ice Lake server, family 6 model 106), under KVM.
ICE_LAKE = (
    "GenuineIntel",
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology "
    "nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 "
    "sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm "
    "abm 3dnowprefetch invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust "
    "bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt "
    "clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves wbnoinvd ida arat "
    "avx512vbmi pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme "
    "avx512_vpopcntdq rdpid md_clear flush_l1d arch_capabilities",
)
# Intel Xeon Platinum 8175M (Skylake-SP, family 6 model 85 stepping 4), under KVM.
SKYLAKE_X = (
    "GenuineIntel",
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology "
    "nonstop_tsc aperfmperf eagerfpu pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic "
    "movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm "
    "3dnowprefetch fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm mpx avx512f "
    "avx512dq rdseed adx smap clflushopt clwb avx512cd avx512bw avx512vl xsaveopt xsavec "
    "xgetbv1 xsaves ida arat pku ospke",
)
# AMD EPYC (Zen 4 "Genoa", family 25 model 17), under a hypervisor.
ZEN4 = (
    "AuthenticAMD",
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl "
    "xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid "
    "sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor "
    "lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext vmmcall "
    "fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap "
    "avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 "
    "xsaves avx512_bf16 clzero xsaveerptr arat avx512vbmi umip avx512_vbmi2 gfni vaes "
    "vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm",
)
# AMD Ryzen 9 9950X (Zen 5, family 26).
ZEN5 = (
    "AuthenticAMD",
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good amd_lbr_v2 "
    "nopl xtopology nonstop_tsc cpuid extd_apicid aperfmperf rapl pni pclmulqdq monitor ssse3 "
    "fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm "
    "extapic cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw ibs skinit wdt tce topoext "
    "perfctr_core perfctr_nb bpext perfctr_llc mwaitx cpb cat_l3 cdp_l3 hw_pstate ssbd mba "
    "perfmon_v2 ibrs ibpb stibp ibrs_enhanced vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 "
    "erms invpcid cqm rdt_a avx512f avx512dq adx smap avx512ifma clflushopt clwb avx512cd "
    "sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc "
    "cqm_mbm_total cqm_mbm_local user_shstk avx_vnni avx512_bf16 clzero irperf xsaveerptr rdpru "
    "wbnoinvd cppc arat npt lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid "
    "decodeassists pausefilter pfthreshold v_vmsave_vmload vgif v_spec_ctrl vnmi avx512vbmi "
    "umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
    "avx512_vpopcntdq rdpid bus_lock_detect movdiri movdir64b overflow_recov succor smca fsrm "
    "avx512_vp2intersect flush_l1d amd_lbr_pmc_freeze",
)
# AMD Ryzen 9 5950X (Zen 3): AVX2, no AVX-512.
ZEN3 = (
    "AuthenticAMD",
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl "
    "nonstop_tsc cpuid extd_apicid aperfmperf pni pclmulqdq monitor ssse3 fma cx16 sse4_1 "
    "sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm extapic cr8_legacy "
    "abm sse4a misalignsse 3dnowprefetch osvw ibs skinit wdt tce topoext perfctr_core "
    "perfctr_nb bpext perfctr_llc mwaitx cpb cat_l3 cdp_l3 hw_pstate ssbd mba ibrs ibpb stibp "
    "vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a rdseed adx smap clflushopt "
    "clwb sha_ni xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total "
    "cqm_mbm_local clzero irperf xsaveerptr wbnoinvd arat npt lbrv svm_lock nrip_save "
    "tsc_scale vmcb_clean flushbyasid decodeassists pausefilter pfthreshold avic "
    "v_vmsave_vmload vgif umip pku ospke vaes vpclmulqdq rdpid overflow_recov succor smca",
)
# AWS Graviton2 (Arm Neoverse N1): /proc/cpuinfo has no vendor_id or flags line.
GRAVITON2_CPUINFO = (
    "processor       : 0\nBogoMIPS        : 243.75\n"
    "Features        : fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid "
    "asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
    "CPU variant     : 0x3\nCPU part        : 0xd0c\nCPU revision    : 1\n"
)

CPUS = {"sapphire_rapids": SAPPHIRE_RAPIDS, "granite_rapids": GRANITE_RAPIDS,
        "ice_lake": ICE_LAKE, "skylake_x": SKYLAKE_X, "zen4": ZEN4, "zen5": ZEN5, "zen3": ZEN3}
# What Debian 12's OpenBLAS 0.3.21 accepts as OPENBLAS_CORETYPE among mlxvlm's names.
DEBIAN_0_3_21 = frozenset({"Cooperlake", "SkylakeX", "Haswell"})
NEWER = DEBIAN_0_3_21 | {"SapphireRapids"}


def cpuinfo_file(tmp_path, vendor, flags, processors=2):
    """A /proc/cpuinfo with `processors` blocks of the CPU's vendor and flags."""
    block = (f"processor\t: {{n}}\nvendor_id\t: {vendor}\ncpu family\t: 6\n"
             f"model name\t: some CPU\nflags\t\t: {flags}\nbogomips\t: 4800.00\n\n")
    path = tmp_path / "cpuinfo"
    path.write_text("".join(block.format(n=n) for n in range(processors)))
    return str(path)


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_cpuinfo_is_read_for_vendor_and_flags(tmp_path, cpu):
    vendor, flags = CPUS[cpu]
    assert openblas_cores.cpu_vendor_and_flags(cpuinfo_file(tmp_path, vendor, flags)) == (
        vendor, frozenset(flags.split()))


def test_cpuinfo_of_an_arm_cpu_or_none_gives_no_flags(tmp_path):
    arm = tmp_path / "cpuinfo"
    arm.write_text(GRAVITON2_CPUINFO)
    assert openblas_cores.cpu_vendor_and_flags(str(arm)) == ("", frozenset())
    assert openblas_cores.cpu_vendor_and_flags(str(tmp_path / "missing")) == ("", frozenset())
    assert openblas_cores.openblas_cores_for(frozenset()) == []


def flags_of(cpu):
    return frozenset(CPUS[cpu][1].split())


@pytest.mark.parametrize("cpu, cores", [
    ("sapphire_rapids", ["SapphireRapids", "Cooperlake", "SkylakeX", "Haswell"]),
    ("granite_rapids", ["SapphireRapids", "Cooperlake", "SkylakeX", "Haswell"]),
    ("zen4", ["Cooperlake", "SkylakeX", "Haswell"]),
    ("zen5", ["Cooperlake", "SkylakeX", "Haswell"]),
    ("ice_lake", ["SkylakeX", "Haswell"]),
    ("skylake_x", ["SkylakeX", "Haswell"]),
    ("zen3", ["Haswell"]),
])
def test_kernels_each_cpu_can_run(cpu, cores):
    assert openblas_cores.openblas_cores_for(flags_of(cpu)) == cores


@pytest.mark.parametrize("cpu, default, accepted, expected", [
    # Debian 12's 0.3.21 on Intel CPUs newer than it: SSE3 kernels; it has no
    # SapphireRapids kernels, so the best it has that the CPU runs.
    ("sapphire_rapids", "Prescott", DEBIAN_0_3_21, "Cooperlake"),
    ("granite_rapids", "Prescott", DEBIAN_0_3_21, "Cooperlake"),
    ("sapphire_rapids", "Prescott", NEWER, "SapphireRapids"),
    ("ice_lake", "Prescott", DEBIAN_0_3_21, "SkylakeX"),
    ("skylake_x", "Sandybridge", DEBIAN_0_3_21, "SkylakeX"),
    # AVX2 kernels on AMD CPUs with AVX-512.
    ("zen5", "Zen", DEBIAN_0_3_21, "Cooperlake"),
    ("zen4", "Haswell", frozenset({"SkylakeX", "Haswell"}), "SkylakeX"),
    # OpenBLAS knows the CPU: its own pick stands, also a lesser one of the same set.
    ("zen4", "Cooperlake", DEBIAN_0_3_21, None),
    ("sapphire_rapids", "SkylakeX", NEWER, None),
    ("skylake_x", "SkylakeX", DEBIAN_0_3_21, None),
    ("zen3", "Zen", DEBIAN_0_3_21, None),
    # An AVX2 CPU on SSE3 kernels gets the AVX2 ones.
    ("zen3", "Prescott", DEBIAN_0_3_21, "Haswell"),
    # A build without the faster kernels (not DYNAMIC_ARCH), a pick not known to
    # mlxvlm (a newer OpenBLAS's), or no pick (the probe failed): left alone.
    ("sapphire_rapids", "Prescott", frozenset(), None),
    ("sapphire_rapids", "Prescott", frozenset({"Haswell"}), "Haswell"),
    ("zen5", "Zen5", DEBIAN_0_3_21, None),
    ("zen5", None, DEBIAN_0_3_21, None),
])
def test_decision(cpu, default, accepted, expected):
    assert openblas_cores.openblas_core_choice({}, flags_of(cpu), default, accepted) == expected


def test_decision_keeps_the_users_coretype_and_leaves_other_cpus():
    choose = openblas_cores.openblas_core_choice
    for user in ("Haswell", "Prescott", "SkylakeX"):
        assert choose({"OPENBLAS_CORETYPE": user}, flags_of("sapphire_rapids"), "Prescott",
                      NEWER) is None
    assert choose({"OPENBLAS_CORETYPE": " "}, flags_of("ice_lake"), "Prescott",
                  NEWER) == "SkylakeX"  # blank is unset
    # Without every instruction set SkylakeX's kernels use, and without AVX2 at all.
    assert choose({}, flags_of("ice_lake") - {"avx512bw"}, "Prescott", NEWER) == "Haswell"
    assert choose({}, frozenset({"sse2", "sse3", "avx"}), "Prescott", NEWER) is None
    assert choose({}, frozenset(), "ARMV8", NEWER) is None


def test_verbose_says_which_kernels_run_and_who_chose_them():
    note = openblas_cores.openblas_core_note
    spr = flags_of("sapphire_rapids")
    assert note("Cooperlake", {}, spr, forced="Cooperlake", default="Prescott") == (
        ", Cooperlake kernels (chosen by mlxvlm: OpenBLAS picks Prescott on this AVX-512 "
        "CPU; set OPENBLAS_CORETYPE to choose others)")
    assert note("Haswell", {}, flags_of("zen3"), forced="Haswell", default="Prescott") == (
        ", Haswell kernels (chosen by mlxvlm: OpenBLAS picks Prescott on this AVX2 CPU; "
        "set OPENBLAS_CORETYPE to choose others)")
    assert note("Cooperlake", {}, flags_of("zen4"), default="Cooperlake") == ", Cooperlake kernels"
    assert note("ARMV8", {}, frozenset()) == ", ARMV8 kernels"
    # A user's OPENBLAS_CORETYPE that leaves the CPU's AVX-512 unused stands, and is said.
    assert note("Haswell", {"OPENBLAS_CORETYPE": "Haswell"}, spr) == (
        ", Haswell kernels (OPENBLAS_CORETYPE=Haswell; this CPU has AVX-512: "
        "OPENBLAS_CORETYPE=SkylakeX runs float32 products faster)")
    assert note("SkylakeX", {"OPENBLAS_CORETYPE": "SkylakeX"}, spr) == ", SkylakeX kernels"
    # A build with nothing faster for this CPU.
    assert note("Prescott", {}, spr, default="Prescott") == (
        ", Prescott kernels (this CPU has AVX-512, which this OpenBLAS build has no kernels for)")


def test_probe_is_asked_once_and_only_for_what_can_help(tmp_path, monkeypatch):
    """The first process asks OpenBLAS for its own pick, then (only as it is below the
    CPU's kernels) which of those it accepts; later ones read the kept answer."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    asked = []

    def children(library, coretypes):
        asked.append(list(coretypes))
        return ["Prescott" if c is None else (c if c != "SapphireRapids" else "Prescott")
                for c in coretypes]

    monkeypatch.setattr(openblas_cores, "_corenames_in_children", children)
    flags = flags_of("sapphire_rapids")
    want = ("Prescott", frozenset({"Cooperlake", "SkylakeX", "Haswell"}))
    assert openblas_cores.probe_openblas_cores("libopenblas.so.0", flags) == want
    assert asked == [[None], ["SapphireRapids", "Cooperlake", "SkylakeX", "Haswell"]]
    assert openblas_cores.probe_openblas_cores("libopenblas.so.0", flags) == want
    assert len(asked) == 2  # kept
    kept, = (tmp_path / "mlxvlm").glob("openblas-cores-*.json")
    assert json.loads(kept.read_text())["default"] == "Prescott"

    # OpenBLAS knows the CPU (its own pick is of the CPU's best set): nothing more asked.
    asked.clear()
    monkeypatch.setattr(openblas_cores, "_corenames_in_children",
                        lambda library, coretypes: asked.append(list(coretypes)) or ["SkylakeX"])
    assert openblas_cores.probe_openblas_cores("libopenblas.so.0", flags_of("skylake_x")) == (
        "SkylakeX", frozenset())
    assert asked == [[None]]


# ------------------------------------------------------------- with the real OpenBLAS

OPENBLAS = ctypes.util.find_library("openblas") if sys.platform == "linux" else None
needs_x86_openblas = pytest.mark.skipif(
    OPENBLAS is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs the system OpenBLAS on x86-64")


@needs_x86_openblas
def test_probe_reads_the_names_a_real_openblas_accepts():
    """Every x86-64 CPU runs the SSE3 kernels, so a DYNAMIC_ARCH build (Debian's) takes
    "Prescott"; a name it does not know falls back to its own pick."""
    got = openblas_cores._corenames_in_children(OPENBLAS, ["Prescott", "NoSuchCore"])
    assert got[0] == "Prescott"
    assert got[1] != "NoSuchCore"


LOAD_PROBE = """
import ctypes, os, sys
import numpy as np
import types
# mlxvlm.cpu's BLAS modules alone: the packages stand in for themselves, so that
# mlxvlm/__init__.py (which loads OpenBLAS its own way) does not run.
for name, path in (("mlxvlm", sys.argv[1]), ("mlxvlm.cpu", os.path.join(sys.argv[1], "cpu"))):
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
from mlxvlm.cpu import blas as backend, openblas_cores
# As on a CPU this OpenBLAS does not know: it would pick its SSE3 kernels. The names
# it accepts are asked of it for real: a release older than the CPU takes only some of
# those the CPU's flags allow (Debian's 0.3.21 has no SapphireRapids kernels).
def probe(library, flags):
    names = openblas_cores.openblas_cores_for(flags)
    got = openblas_cores._corenames_in_children(library, names)
    accepted = [name for name, reported in zip(names, got) if reported == name]
    print(accepted[0] if accepted else "none", end=" | ")
    return "Prescott", frozenset(accepted)
openblas_cores.probe_openblas_cores = probe
backend.preload_openblas()
blas = ctypes.CDLL(None)
I, P = ctypes.c_int, ctypes.c_void_p
blas.cblas_sgemm.argtypes = [I, I, I, I, I, I, ctypes.c_float, P, I, P, I, ctypes.c_float, P, I]
a = np.random.default_rng(0).normal(size=(150, 300)).astype(np.float32)
b = np.random.default_rng(1).normal(size=(300, 200)).astype(np.float32)
c = np.zeros((150, 200), np.float32)
blas.cblas_sgemm(101, 111, 111, 150, 200, 300, 1.0, a.ctypes.data, 300, b.ctypes.data, 200,
                 0.0, c.ctypes.data, 200)
err = float(np.abs(c - a.astype(np.float64) @ b).max())
print(backend.openblas_status, "|", os.environ.get("OPENBLAS_CORETYPE", "unset"), "|", err)
"""


@needs_x86_openblas
def test_openblas_loads_with_the_kernels_mlxvlm_names_and_computes_right(tmp_path):
    """With OpenBLAS reported to pick SSE3 kernels here, it loads with the best ones this
    CPU runs, the user's environment is left as it was, and products are right; with the
    user's OPENBLAS_CORETYPE, theirs are used and the faster choice is said."""
    _, flags = openblas_cores.cpu_vendor_and_flags()
    best = openblas_cores.openblas_cores_for(flags)
    if not best:
        pytest.skip("this CPU has no AVX2: mlxvlm names no kernels on it")

    def run(env_extra):
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
        env.update(env_extra, XDG_CACHE_HOME=str(tmp_path), MLXVLM_NO_GEMV_FORWARD="1")
        out = subprocess.run([sys.executable, "-c", LOAD_PROBE, str(Path(openblas_cores.__file__).parents[1])],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        *named, status, coretype, err = (part.strip() for part in out.stdout.split("|"))
        assert float(err) < 1e-3
        return named, status, coretype

    (named,), status, coretype = run({})
    assert named in best, named  # the best kernels of the CPU's that this build runs
    assert f"{named} kernels (chosen by mlxvlm: OpenBLAS picks Prescott" in status, status
    assert coretype == "unset"
    named, status, coretype = run({"OPENBLAS_CORETYPE": "Prescott"})
    assert named == []  # the user's choice: nothing is probed
    assert "Prescott kernels (OPENBLAS_CORETYPE=Prescott; this CPU has" in status, status
    assert coretype == "Prescott"
