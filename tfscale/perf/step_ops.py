"""How many ops a traced step runs outside XLA: what the host dispatches one by one every step.

An XLA-compiled function runs as one op (its call); everything else in the step's graph, and in the
functions it calls (the loop body, branches, nested tf.functions), runs as ops of its own. The inputs
of a function (`Placeholder` / `_Arg`: a loop body's captured variables) are not ops that run.
"""

from __future__ import annotations

import collections

import tensorflow as tf

_NOT_RUN = ("Placeholder", "_Arg")


def ops_outside_xla(function) -> collections.Counter:
    """Op type -> count over one call of `function` (a tf.function's concrete function, or its GraphDef)."""
    graph_def = function if isinstance(function, tf.compat.v1.GraphDef) else function.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    counts = collections.Counter()

    def visit(nodes, calling: frozenset) -> None:
        for node in nodes:
            if node.op in _NOT_RUN:
                continue
            counts[node.op] += 1
            for name in _called_functions(node):
                called = library.get(name)
                if called is not None and name not in calling and not _compiled(called):
                    visit(called.node_def, calling | {name})

    visit(graph_def.node, frozenset())
    return counts


def _called_functions(node) -> list[str]:
    names = []
    for value in node.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names += [f.name for f in value.list.func]
    return names


def _compiled(function_def) -> bool:
    attr = function_def.attr.get("_XlaMustCompile")
    return attr is not None and attr.b
