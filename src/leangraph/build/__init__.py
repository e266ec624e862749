"""Build: warm-up and capture, from the validated call to one frozen record per graph.

:func:`leangraph.build.builder.build_graphs` drives one :class:`~leangraph.build.graph.GraphBuilder`
per graph through warm-up (:mod:`.warmup`) and capture (:mod:`.capture`) in the plan's order,
while a :class:`~leangraph.build.recorder.MemoryRecorder` samples memory; each builder then
hands over a :class:`~leangraph.build.record.GraphRecord`, which the runtime replays.
"""
