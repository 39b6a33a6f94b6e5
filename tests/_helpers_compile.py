"""A torch.compile backend for tests that records WHAT each compiled graph computes.

`RECORDING` runs dynamo's graphs as aot_eager does and keeps the op names of every graph (a
checkpoint's body included) in `GRAPHS`, so a test can tell whether a decoder block's attention
and MLP, or the log-prob head's log-softmax, were compiled, and not merely that something was.
"""

from __future__ import annotations

RECORDING = "scalerl_test_recording"
GRAPHS: list = []  # one set of op names per graph compiled by RECORDING in this process


def register_recording_backend() -> None:
    """Register RECORDING with dynamo (idempotent; once per process)."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    if RECORDING in torch._dynamo.list_backends(exclude_tags=()):
        return

    def recording(gm, example_inputs):
        graphs = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]  # with a checkpoint's body
        GRAPHS.append({str(node.target) for g in graphs for node in g.graph.nodes
                       if node.op in ("call_function", "call_method")})
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.register_backend(recording, name=RECORDING)


def compiled_ops(start: int = 0) -> set:
    """The op names of the graphs RECORDING compiled since GRAPHS[start]."""
    return set().union(*GRAPHS[start:]) if len(GRAPHS) > start else set()


def has_op(ops: set, name: str) -> bool:
    return any(name in op for op in ops)
