"""The benchmarks' reading of this process's memory: a peak that a touched allocation raises and a reset lowers."""

from __future__ import annotations

from loopline.bench._procstat import reset_peak, status_bytes

MIB = 2**20


def test_the_peak_rises_with_touched_memory_and_a_reset_brings_it_back_to_the_resident_set() -> None:
    base = reset_peak()
    assert base == status_bytes("VmRSS") > 10 * MIB  # a Python interpreter with pytest loaded
    block = bytearray(200 * MIB)  # zero-filled: every page touched
    grown = status_bytes("VmHWM")
    assert grown - base >= 190 * MIB
    del block
    assert status_bytes("VmHWM") > grown - 10 * MIB  # the peak stays after the memory is freed (the kernel's
    # counters are cached per CPU: a few pages off)...
    assert reset_peak() < grown - 150 * MIB  # ...until it is reset to the resident set
    assert status_bytes("VmHWM") < grown - 150 * MIB
    assert status_bytes("NoSuchField") == 0
