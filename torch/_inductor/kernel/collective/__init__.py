"""Collective custom-op autotuning in Inductor: every rank of a process group picks the
same choice. Upstream's patched files import :mod:`.hooks` alone; the modules below it
are described in ``docs/source/collective_autotuning.md``.
"""
