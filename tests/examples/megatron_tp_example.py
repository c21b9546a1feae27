"""README's Megatron-port example with tensor parallelism inside each pipeline stage: pipeline 2 x tensor 2.

Run from the repository root (CPU, gloo): ``torchrun --nproc-per-node 4 tests/examples/megatron_tp_example.py``
(``tests/e2e/test_readme.py`` runs it).  Megatron's rank order puts the two tensor-parallel ranks of a stage next
to each other: ranks 0, 1 are stage 0, ranks 2, 3 stage 1.  Each rank's chunk is parallelised with torch's
``parallelize_module`` on the ``tp`` dimension of ``parallel_state.get_device_mesh()``; with
``sequence_parallel=True`` the norm and the residual stream hold this rank's sequence shard ``[s/2, b, h]``
(``SequenceParallel(sequence_dim=0)``, a column-parallel ``up`` that all-gathers the sequence, a row-parallel
``down`` that reduce-scatters it), and that shard is what the schedule sends between the stages.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from engine import parallel_state
from engine.model_parallel_config import ModelParallelConfig
from engine.runtime.p2p import TAG_ACT, record_messages
from engine.schedules import get_forward_backward_func

PP, TP, HIDDEN, SEQ, MBS, M = 2, 2, 16, 8, 4, 4


class Chunk(nn.Module):
    """One pipeline stage: ``[s/TP, b, h]`` in and out; the first stage cuts its shard from the data."""

    def __init__(self, config, first, tp_mesh):
        super().__init__()
        self.config, self.first, self.input_tensor = config, first, None
        self.tp_rank = tp_mesh.get_local_rank()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        parallelize_module(self, tp_mesh, {"norm": SequenceParallel(sequence_dim=0),
                                           "up": ColwiseParallel(input_layouts=Shard(0)),
                                           "down": RowwiseParallel(output_layouts=Shard(0))})

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    def forward(self, x):                          # [s/TP, b, h] -> [s/TP, b, h]
        x = x.chunk(TP)[self.tp_rank] if self.first else self.input_tensor
        return x + self.down(torch.relu(self.up(self.norm(x))))


def forward_step(data_iterator, model):
    x, target = next(data_iterator)
    out = model(x)

    def loss_func(output):                         # this rank's sequence shard: its share of the full mean
        loss = ((output - target.chunk(TP)[model.tp_rank]) ** 2).sum() / target.numel()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=parallel_state.get_tensor_model_parallel_group())  # the full mean
        return loss, {"lm loss": reported}
    return out, loss_func


def finalize_grads(models, num_tokens, pg_collection=None, force_all_reduce=False):
    """Give each DTensor gradient its parameter's layout: the norm's (and the row-parallel bias's) gradients are
    per-shard partial sums, all-reduced over the tensor-parallel group here."""
    for p in models[0].parameters():
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def main():
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    pp_rank, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    config = ModelParallelConfig(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
                                 sequence_parallel=True, pipeline_dtype=torch.float32, hidden_size=HIDDEN,
                                 finalize_model_grads_func=finalize_grads)
    torch.manual_seed(0)                           # the same full weights on both tensor-parallel ranks
    model = Chunk(config, first=pp_rank == 0, tp_mesh=parallel_state.get_device_mesh("cpu")["tp"])
    data = [(torch.randn(SEQ, MBS, HIDDEN), torch.randn(SEQ, MBS, HIDDEN)) for _ in range(M)]

    forward_backward = get_forward_backward_func()  # 1F1B, from parallel_state
    with record_messages() as sent:
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(data), model=model,
                                  num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
    shapes = sorted({r.shape for r in sent if r.tag == TAG_ACT})
    print(f"rank {dist.get_rank()} (stage {pp_rank}, tp {tp_rank}): activation messages {shapes}, "
          f"losses {[round(d['lm loss'].item(), 4) for d in losses]}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
