"""Collective custom-op autotuning in Inductor.

Upstream's files import :mod:`.hooks` alone; the other modules do the work below it,
one concern each (see ``docs/source/collective_autotuning.md``): which ops communicate
(``detection``), the choices every rank names alike (``choices``, compiled with their
neighbours by ``choice_modules``), one call site's decision (``selection``, timed by
``timing``), one Store session per graph (``graph_sessions``), dynamic sizes
(``dispatch``, ``range_graphs``), the records a decision leaves (``records``), the
collectives a choice never waited for (``waits``) and Dynamo's compile callbacks
(``dynamo_callbacks``).
"""
