"""`benchmarks/kernel_benchmarks/kernel_fingerprint.py`'s notion of "the same code": source locations,
comments, debug sections and temporary label numbers do not count; any instruction does."""

from __future__ import annotations

from bench_support import load_benchmark

fingerprint = load_benchmark("kernel_fingerprint", "kernel_benchmarks")

PTX = """.visible .entry k(
\t.loc 1 12 3
$L__tmp4:
\tadd.s32 %r1, %r2, %r3; // a comment
\tbra $L__tmp4;
$L__func_end0:
\t.section .debug_info { .b8 1 }
"""


def test_locations_labels_and_debug_information_do_not_count() -> None:
    moved = (
        PTX.replace(".loc 1 12 3", ".loc 1 90 7").replace("$L__tmp4", "$L__tmp9").replace(".b8 1", ".b8 2")
    )
    assert fingerprint.code_of(PTX, "sm90") == fingerprint.code_of(moved, "sm90")
    assert "debug_info" not in fingerprint.code_of(PTX, "sm90")


def test_an_instruction_counts() -> None:
    changed = PTX.replace("add.s32", "sub.s32")
    assert fingerprint.code_of(PTX, "sm90") != fingerprint.code_of(changed, "sm90")
