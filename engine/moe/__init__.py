"""Mixture-of-experts layers with expert parallelism, for pipecast's models and a user's.

* :class:`MoELayer` -- router, SwiGLU experts sharded over the expert-parallel group, optional shared experts
  (:mod:`engine.moe.layer`);
* :class:`TopKRouter` -- softmax or DeepSeek-style sigmoid scores with an expert bias, the load-balancing loss
  (Megatron-Core's ``MoEAuxLossAutoScaler`` contract), an optional capacity factor, per-expert statistics
  (:mod:`engine.moe.router`);
* :func:`dispatch` / :func:`combine` -- the token all-to-all with uneven splits (:mod:`engine.moe.dispatch`).

Expert parallelism: build the layers with ``ep_group=pg_collection.ep`` (or
``engine.parallel_state.get_expert_model_parallel_group()``) after
``initialize_model_parallel(expert_model_parallel_size=E)``; reduce the gradients of expert parameters
(:func:`is_expert_parameter`) over ``pg_collection.expt_dp`` and the others over ``pg_collection.dp``.  Set
``config.num_moe_experts`` so the schedules publish the auxiliary-loss gradient scale.

Tensor parallelism (``expert_tensor_parallel_size=1``): call :meth:`MoELayer.shard_tokens` with the ``tp``
``DeviceMesh`` so that each tensor-parallel rank routes its own share of the sequence; then give the router's
weight (a ``Replicate`` DTensor) its placements back (its ``Partial`` gradient summed over ``tp``) and reduce the
experts over ``pg_collection.expt_dp``, which with expert-tensor size 1 holds the tensor-parallel ranks (see
:mod:`engine.moe.layer`).

Overlap with the other microbatch of a cell (DualPipeV's cells, Megatron's combined 1F1B under
``config.overlap_moe_expert_parallel_comm=True``): nothing to do for these layers -- their all-to-alls are
overlap points.  A user's layer joins the same way: start its collective asynchronously and wait on it through
:func:`engine.runtime.overlap.exchange` (or call :func:`engine.runtime.overlap.overlap_point` between starting and
waiting), in its forward and in its autograd backward; see :mod:`engine.runtime.overlap`.
"""
from ..runtime.overlap import exchange, overlap_point
from .dispatch import A2A_TRAFFIC, combine, dispatch
from .layer import GroupedExperts, MoELayer, SwiGLU, is_expert_parameter, routers
from .router import AuxLossAutoScaler, Routing, RouterStats, TopKRouter, load_balancing_loss

__all__ = ["MoELayer", "TopKRouter", "SwiGLU", "GroupedExperts", "Routing", "RouterStats", "AuxLossAutoScaler",
           "load_balancing_loss", "dispatch", "combine", "A2A_TRAFFIC", "is_expert_parameter", "routers",
           "exchange", "overlap_point"]
