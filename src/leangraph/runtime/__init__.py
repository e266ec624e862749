"""Runtime: replay and lifecycle of graphed callables built from their frozen records.

:class:`~leangraph.runtime.graphed.GraphedCallable` replays one graph; gradient routing
(:mod:`.grads`), the zero-bubble weight step (:mod:`.weight`), pending backwards of one call
(:mod:`.pending`), the replay argument checks (:mod:`.signature`), what torch DDP around a
replay expects (:mod:`.ddp`) and debug-mode output guards (:mod:`.guard`) are its parts.
"""
