"""The runtime layer: runs a plan on real ranks (imports torch; builds on :mod:`engine.plan` only).

* :mod:`engine.runtime.process_groups`: :class:`ProcessGroupCollection` and :func:`build_process_groups`.
* :mod:`engine.runtime.gloo_io`: the gloo I/O thread priority of the pipeline groups.
* :mod:`engine.runtime.p2p`: the P2P communicator (activations and gradients between stages).
* :mod:`engine.runtime.step`: the per-microbatch mechanics (forward with the loss contract, backward, deallocation).
* :mod:`engine.runtime.executor`: one executor for every plan.
* :mod:`engine.runtime.recompute`: activation recomputation (full, selective, by microbatch), exact under split
  backward.
* :mod:`engine.runtime.main_grad`: fp32 ``main_grad`` accumulation beside bf16 parameters.
* :mod:`engine.runtime.tracing`: the span hook the executor reports to.
"""
