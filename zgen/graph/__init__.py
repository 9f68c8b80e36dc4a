"""The typed compute graph a model is: typed nodes (:mod:`~zgen.graph.nodes`), the graph and its
shape checker (:mod:`~zgen.graph.core`) and the decoder architectures built from them
(:mod:`~zgen.graph.decoder`). It describes; the runtime (:mod:`zgen.runtime`) compiles and runs it."""
