"""Bring your own model: a GPT-2-style model (Hugging Face's layout, batch-first, tied embedding and head) trained
with pipecast's Megatron-style schedules on 2 local gloo ranks (1F1B).

Run from the repository root: ``python tests/examples/byom_example.py``.  The glue a user writes is the section "the glue";
the same functions split Hugging Face's ``GPT2LMHeadModel`` (``tests/runtime/test_model_split.py`` checks both).
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine import ModelParallelConfig, finalize_model_grads, looped_stages, split_model
from engine import parallel_state
from engine.schedules import get_forward_backward_func


# ---- a GPT-2-style model in Hugging Face's layout (stands in for transformers.GPT2LMHeadModel) ----------------------

class Block(nn.Module):
    """Pre-norm transformer block with its own signature: ``forward(hidden_states, attention_mask=None)`` on
    ``[b, s, h]`` returns a tuple ``(hidden_states,)``, as Hugging Face blocks do."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.c_attn, self.c_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, hidden_states, attention_mask=None):
        b, s, h = hidden_states.shape
        qkv = self.c_attn(self.ln_1(hidden_states)).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # [b, nh, s, d] each
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None)
        x = hidden_states + self.c_proj(y.transpose(1, 2).reshape(b, s, h))
        return (x + self.mlp(self.ln_2(x)),)


class TinyGPT2(nn.Module):
    """``transformer.{wte, wpe, drop, h, ln_f}`` and ``lm_head`` (tied to ``wte``): ``[b, s]`` ids -> ``[b, s, V]``."""

    def __init__(self, vocab: int = 64, hidden: int = 16, heads: int = 2, layers: int = 4, seq: int = 8):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte, self.transformer.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.transformer.drop = nn.Dropout(0.0)
        self.transformer.h = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.transformer.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        for emb in (self.transformer.wte, self.transformer.wpe):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, input_ids):
        t = self.transformer
        x = t.drop(t.wte(input_ids) + t.wpe(torch.arange(input_ids.shape[1], device=input_ids.device)))
        for block in t.h:
            x = block(x)[0]
        return self.lm_head(t.ln_f(x))


# ---- the glue -------------------------------------------------------------------------------------------------------

def embed(chunk, input_ids):                                  # first stage: [b, s] ids -> [b, s, h]
    t = chunk.transformer
    return t.drop(t.wte(input_ids) + t.wpe(torch.arange(input_ids.shape[1], device=input_ids.device)))


def split_gpt2(model, config, stages):
    return split_model(model, layers="transformer.h", stages=stages, config=config, batch_first=True,
                       first=["transformer.wte", "transformer.wpe", "transformer.drop"],
                       last=["transformer.ln_f", "lm_head"], embed=embed)  # last stage: ln_f, lm_head in order


def loss_func(labels, logits):                                # 3-tuple: summed loss, token count, logged values
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    n = torch.tensor(labels.numel(), dtype=torch.int)
    return loss, n, {"lm loss": loss.detach() / n}


def forward_step(data_iterator, model):
    input_ids, labels = next(data_iterator)
    return model(input_ids), partial(loss_func, labels)


# ---- a training loop ------------------------------------------------------------------------------------------------

def batches(step: int, num_microbatches: int, micro_batch_size: int = 2, seq: int = 8, vocab: int = 64):
    """Counting sequences (token t + 1 follows t, mod V) from random starts: ``(input_ids, labels)`` ``[b, s]``."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, vocab, (num_microbatches, micro_batch_size, 1), generator=g)
    ids = (starts + torch.arange(seq + 1)) % vocab
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def main(rank: int, world_size: int, steps: int = 20, num_microbatches: int = 4) -> list[float]:
    """Train ``steps`` steps on ``world_size`` pipeline ranks; returns the mean loss per step (last rank)."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    torch.manual_seed(0)
    model = TinyGPT2()                                        # the same model on every rank (same seed)
    config = ModelParallelConfig(pipeline_model_parallel_size=world_size, pipeline_dtype=torch.float32,
                                 hidden_size=16, finalize_model_grads_func=finalize_model_grads)
    chunks = split_gpt2(model, config, looped_stages(rank, world_size))
    optimizer = torch.optim.AdamW(nn.ModuleList(chunks).parameters(), lr=1e-2)
    schedule = get_forward_backward_func()
    means = []
    for step in range(steps):
        optimizer.zero_grad()
        losses = schedule(forward_step_func=forward_step, data_iterator=iter(batches(step, num_microbatches)),
                          model=chunks[0], num_microbatches=num_microbatches, seq_length=8, micro_batch_size=2)
        optimizer.step()
        if losses:
            means.append(sum(float(x["lm loss"]) for x in losses) / len(losses))
            print(f"step {step}: loss {means[-1]:.4f} (ln V = {math.log(64):.4f})")
    parallel_state.destroy_model_parallel()
    return means


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        from engine import spawn                             # engine.spawn(fn, world_size): local gloo ranks
        spawn(main, 2, timeout_s=120)
    except ImportError:                                      # until engine.spawn lands: the tests' launcher
        from tests.helpers.distributed import run_ranks
        run_ranks(main, 2, timeout=60)
