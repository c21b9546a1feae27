"""Trainer overhead per step beside torch.distributed.pipelining driving the same model chunks (issue 34's goal).

A launch-bound tiny GPT (the recipe's model, ``model.family`` default, tied embeddings: 4 layers, hidden 16, 2
heads, 16 tokens, microbatches of 2 sequences, ``--microbatches`` of them) takes whole training steps on three
engines at pp=1 (one process) and pp=2 (2 gloo ranks, 2 layers per stage):

* ``pipecast``: :meth:`engine.Trainer.step_on_device` -- the trainer's whole step: zero grads, its schedule
  (no pipelining / 1F1B), the gradient sync (tied-embedding sum over the two ends at pp=2), the global-norm clip,
  the loss reduced on the device, the NaN / inf flag, fused AdamW, the LR schedule;
* ``torch <Schedule>``: ``torch.distributed.pipelining``'s ``ScheduleGPipe`` / ``Schedule1F1B`` over
  ``PipelineStage`` wrappers of chunks built by the same function with the same seed, then the same step by
  hand (:func:`hand_step`: tied-embedding sum, global-norm clip, loss broadcast, fused AdamW, LR schedule);
* ``compute 1F1B`` / ``compute GPipe``: the same chunks in a plain loop of the forward and backward passes in
  1F1B order (at pp=1: forward, loss, backward per microbatch; at pp=2 rank 0 forwards microbatch ``i+1`` before
  the backward of ``i``) or GPipe order (every forward, then every backward), at pp=2 with a plain ``isend`` /
  ``irecv`` of each activation and input-gradient (every receive posted at the start of the step), then :func:`hand_step`.  It holds the chunks' compute and the
  messages (at pp=2 also the bubble and the message latency on the order's critical path), and as little else as
  a step can; each engine is set against the loop of its own order (pipecast's pp=2 schedule is 1F1B).

Every engine reads its microbatches from the same data pipeline (the trainer's
:class:`~engine.training.data.corpus.Batches`; torch's schedule gets them concatenated, as it splits the batch
itself).  Overhead per step = engine step - compute step (its order), in wall time and in the process's CPU time (all
threads): on a launch-bound model the host's time is what the device waits for, and at pp=2 on a shared machine
the wall time also carries the message latency.  Each repeat is one fresh job per world size
that builds every engine and steps them round-robin (shuffled per round, a barrier before each step; the
step time is the maximum over ranks), so machine load falls on all alike; the figures are medians over repeats of
each job's median step time.  Prints a table and writes ``benchmarks/results/trainer_overhead.json``.

    python benchmarks/trainer_overhead.py                                  # full run (a few minutes on 2 cores)
    python benchmarks/trainer_overhead.py --repeats 1 --steps 3 --warmup 1   # smoke test
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, median, round_robin, write_json  # noqa: E402

MODEL = {"model.num_layers": 4, "model.hidden_size": 16, "model.num_attention_heads": 2, "model.seq_length": 16,
         "training.micro_batch_size": 2, "data.max_bytes": 200_000}
TORCH_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


def trainer_config(pp: int, microbatches: int, run_dir: str):
    from engine.training.config import load_config
    return load_config(None, {**MODEL, "parallel.pipeline": pp, "training.num_microbatches": microbatches,
                              "training.steps": 100_000, "training.eval_interval": 0, "checkpoint.interval": 0,
                              "checkpoint.save_at_end": False, "logging.log_interval": 100_000,
                              "logging.progress_bar": False, "logging.level": "WARNING", "logging.run_dir": run_dir})


# ---------------------------------------------------------------------------------------------------------------
class HandParts:
    """This rank's chunk built as the trainer builds it (same function and seed, no pipecast runtime attached), its
    fused AdamW and LR schedule as the trainer's, and the trainer's data pipeline: each hand engine its own."""

    def __init__(self, trainer, rank: int, pp: int, group):
        import torch
        from engine.training.models.chunk import build_model_chunks
        from engine.training.trainer import lr_lambda
        c = trainer.config
        self.rank, self.pp, self.m, self.group = rank, pp, c.training.num_microbatches, group
        self.chunk = build_model_chunks(c.model, c.ffn_hidden_size, pp, rank, 1, c.training.seed)[0]
        params = [p for p in self.chunk.parameters()]
        o = c.optimizer
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_lambda(step, o.lr, o.min_lr, o.warmup_steps, c.training.steps))
        self.params, self.clip, self.batches, self.step_count = params, o.grad_clip, trainer.batches, 0
        self.counted = [not getattr(p, "shared_embedding_copy", False) for p in params]
        self.tied = next((p for p in params if getattr(p, "shared_embedding", False)), None)

    def data(self) -> list[dict]:
        self.step_count += 1
        return list(self.batches.train(self.step_count - 1, True, True))


def hand_step(h: HandParts, loss_sum):
    """The end of a training step written with plain torch: tied-embedding gradient sum over the two ends, global
    L2 norm (all-reduced over the pipeline) and clip, the loss broadcast from the last stage, AdamW, LR step."""
    import torch
    import torch.distributed as dist
    if h.pp > 1 and h.tied is not None:
        dist.all_reduce(h.tied.grad, group=h.group)
    grads = [p.grad for p in h.params]
    sq = torch.stack([torch.linalg.vector_norm(g) for g, c in zip(grads, h.counted) if c]).pow(2).sum()
    if h.pp > 1:
        dist.all_reduce(sq, group=h.group)
    coef = torch.clamp(h.clip / (sq.sqrt() + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
    if h.pp > 1:
        dist.broadcast(loss_sum, src=h.pp - 1, group=h.group)
    h.optimizer.step()
    h.scheduler.step()
    h.optimizer.zero_grad(set_to_none=True)
    return loss_sum / h.m


# ---------------------------------------------------------------------------------------------------------------
def build_pipecast(trainer, rank: int, pp: int):
    def step():
        trainer.step_on_device()
    return step, lambda: trainer.read_pending()[-1]["loss"]  # read_pending: the host read, outside the timed step


def pass_order(order: str, rank: int, pp: int, m: int) -> list[tuple[str, int]]:
    """This rank's forward ("F") / backward ("B") passes in ``order``: ``GPipe`` every forward then every
    backward; ``1F1B`` one backward after each forward on the last stage, and on the first stage of two the
    forward of microbatch ``i+1`` before the backward of ``i`` (its one warmup forward)."""
    if order == "GPipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if rank == pp - 1:
        return [p for i in range(m) for p in (("F", i), ("B", i))]
    return [("F", 0)] + [p for i in range(1, m) for p in (("F", i), ("B", i - 1))] + [("B", m - 1)]


def build_compute(trainer, rank: int, pp: int, group, order: str):
    """The same chunks in a plain loop of ``order``'s passes (:func:`pass_order`), at pp=2 with a plain ``isend`` /
    ``irecv`` of each activation and input-gradient (rank 0 first stage, rank 1 last; every receive posted at the
    start of the step), then :func:`hand_step`."""
    import torch
    import torch.distributed as dist
    h = HandParts(trainer, rank, pp, group)
    c = trainer.config
    shape = (c.model.seq_length, c.training.micro_batch_size, c.model.hidden_size)
    passes = pass_order(order, rank, pp, h.m)
    first, last = rank == 0, rank == pp - 1

    def step():
        mbs, sends, kept = h.data(), [], {}
        loss_sum = torch.zeros((), dtype=torch.float64)
        # every receive of the step posted at its start (gloo matches them in order: both orders send in microbatch
        # order), so no message waits for its receive to be posted
        recvs = [] if pp == 1 else [(b, dist.irecv(b, 1 - rank, group=group))
                                    for b in (torch.empty(shape) for _ in range(h.m))]
        for kind, i in passes:
            if kind == "F":
                x = None
                if not first:
                    x, work = recvs[i]
                    work.wait()
                    h.chunk.set_input_tensor(x.requires_grad_())
                y = h.chunk(mbs[i]["tokens"] if first else None, mbs[i]["labels"] if last else None)
                if last:
                    y = y.mean()
                    loss_sum += y.detach()
                else:
                    sends.append((y, dist.isend(y.detach(), 1, group=group)))
                kept[i] = (x, y)
            else:
                x, y = kept.pop(i)
                if last:
                    (y / h.m).backward()
                else:
                    g, work = recvs[i]
                    work.wait()
                    y.backward(g)
                if not first:
                    sends.append((x.grad, dist.isend(x.grad, 0, group=group)))
        for _, work in sends:
            work.wait()
        return hand_step(h, loss_sum)
    return step, None


def build_torch(trainer, rank: int, pp: int, group, schedule: str):
    """``torch.distributed.pipelining``: one ``PipelineStage`` per rank around this rank's chunk, ``schedule``;
    loss: mean cross entropy of the last stage's logits (the chunk's own loss, from its logits)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, schedules
    h = HandParts(trainer, rank, pp, group)

    class Stage(nn.Module):  # torch's stage calling convention: tokens in on stage 0, activations elsewhere
        def __init__(self, chunk):
            super().__init__()
            self.chunk = chunk

        def forward(self, x):
            if self.chunk.is_first:
                return self.chunk(x)
            self.chunk.set_input_tensor(x)
            return self.chunk()

    def loss_fn(logits, labels):  # [s, b, V], [b, s]
        s, b, v = logits.shape
        return F.cross_entropy(logits.float().reshape(s * b, v), labels.t().reshape(s * b))

    stage = PipelineStage(Stage(h.chunk), rank, pp, torch.device("cpu"), group=group)
    sched = getattr(schedules, schedule)(stage, h.m, loss_fn=loss_fn)
    first, last = rank == 0, rank == pp - 1

    def step():
        mbs = h.data()
        losses = [] if last else None
        tokens = torch.cat([mb["tokens"] for mb in mbs]) if first else None
        labels = torch.cat([mb["labels"] for mb in mbs]) if last else None
        sched.step(*((tokens,) if first else ()), target=labels, losses=losses)
        loss_sum = torch.stack(losses).detach().sum().double() if last else torch.zeros((), dtype=torch.float64)
        return hand_step(h, loss_sum)
    return step, None


# ---------------------------------------------------------------------------------------------------------------
def job(rank: int, world: int, microbatches: int, warmup: int, steps: int, seed: int) -> dict:
    """Build the engines of this world size (pp = world) and step them round-robin; returns each engine's step
    times (s, maximum over ranks)."""
    import torch.distributed as dist
    from engine import Trainer
    from engine.runtime import gloo_io
    group = None
    if world > 1:  # the hand engines' messages: a gloo group whose I/O thread is reniced as pipecast's pipeline group's
        with gloo_io.lowered_io_priority(gloo_io.default_nice()):
            group = dist.new_group(list(range(world)), backend="gloo")
    with tempfile.TemporaryDirectory() as run_dir, Trainer(trainer_config(world, microbatches, run_dir)) as trainer:
        engines = {f"compute {o}": build_compute(trainer, rank, world, group, o) for o in ("1F1B", "GPipe")}
        engines["pipecast"] = build_pipecast(trainer, rank, world)
        engines |= {f"torch {s}": build_torch(trainer, rank, world, group, s) for s in TORCH_SCHEDULES}
        first_loss = {}
        for label, (step, read) in engines.items():  # the first step: untimed; same init and data -> same loss
            loss = step()
            first_loss[label] = float(read() if read is not None else loss)
        times = round_robin({k: s for k, (s, _) in engines.items()}, warmup, steps, seed,
                            after_round=[a for _, a in engines.values() if a is not None])
        return {"times": times, "first_loss": first_loss}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh jobs per world size (default 3)")
    ap.add_argument("--steps", type=int, default=30, help="timed rounds per job (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds per job (default 5)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/trainer_overhead.json)")
    args = ap.parse_args(argv)
    runs: dict[tuple[int, str], dict[str, list[float]]] = {}  # (pp, engine) -> clock -> per-job medians (s)
    losses: dict[tuple[int, str], float] = {}
    for rep in range(args.repeats):
        for pp in (1, 2):
            res = launch(job, pp, args.microbatches, args.warmup, args.steps, rep)[0]
            for label, clocks in res["times"].items():
                for clock in CLOCKS:
                    runs.setdefault((pp, label), {c: [] for c in CLOCKS})[clock].append(median(clocks[clock]))
                losses[(pp, label)] = res["first_loss"][label]
            print(f"  repeat {rep + 1}/{args.repeats} pp={pp} (wall / cpu ms): " + ", ".join(
                f"{label} {runs[(pp, label)]['wall'][-1] * 1e3:.2f} / {runs[(pp, label)]['cpu'][-1] * 1e3:.2f}"
                for label in res["times"]), flush=True)
    rows = [_row(pp, label, runs, losses) for pp, label in runs]
    goals = _goals(rows)
    _print(rows, goals)
    path = write_json("trainer_overhead", {"model": MODEL, "microbatches": args.microbatches,
                                           "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
                                           "design": "round-robin steps of all engines in each fresh job; overhead ="
                                                     " step - compute step (same job), median over repeats; wall:"
                                                     " perf_counter, cpu: process_time (all threads), max over"
                                                     " ranks",
                                           "rows": rows, "goals": goals}, args.out)
    print(f"wrote {path}")
    return 0 if all(r["loss_matches"] for r in rows) else 1


CLOCKS = ("wall", "cpu")
REFERENCE = {"pipecast": "compute 1F1B", "torch Schedule1F1B": "compute 1F1B", "torch ScheduleGPipe": "compute GPipe"}
"""Each engine's compute loop: the one with its order of passes (pipecast's pp=2 schedule is 1F1B)."""


def _row(pp: int, label: str, runs: dict, losses: dict) -> dict:
    """One engine's figures: per clock the median step (ms) and, beside the compute loop of the same jobs, the
    median over jobs of the difference (the overhead per step)."""
    loss, ref = losses[(pp, label)], losses[(pp, "compute 1F1B")]
    row = {"pp": pp, "engine": label, "reference": REFERENCE.get(label), "first_step_loss": loss, "loss_matches": abs(loss - ref) <= 1e-5 * abs(ref)}
    for clock in CLOCKS:
        ts, compute = runs[(pp, label)][clock], runs[(pp, REFERENCE.get(label, label))][clock]
        row[f"{clock}_ms"] = median(ts) * 1e3
        row[f"{clock}_repeats_ms"] = [t * 1e3 for t in ts]
        if label in REFERENCE:
            row[f"{clock}_overhead_ms"] = median([t - c for t, c in zip(ts, compute)]) * 1e3
    return row


def _goals(rows: list[dict]) -> list[dict]:
    """pipecast's overhead / each torch schedule's, per pp and clock; the goal: at most 0.5."""
    goals = []
    for pp in (1, 2):
        ours = next(r for r in rows if r["pp"] == pp and r["engine"] == "pipecast")
        for r in rows:
            if r["pp"] == pp and r["engine"].startswith("torch"):
                for clock in CLOCKS:
                    ratio = ours[f"{clock}_overhead_ms"] / r[f"{clock}_overhead_ms"]
                    goals.append({"goal": f"pp={pp} {clock}: pipecast overhead / {r['engine']} overhead <= 0.5",
                                  "value": ratio, "met": 0 <= ratio <= 0.5})
    return goals


def _print(rows: list[dict], goals: list[dict]) -> None:
    print(f"\n{'pp':>2} {'engine':<22} {'wall ms':>8} {'overhead':>9} {'cpu ms':>8} {'overhead':>9} "
          f"{'first loss':>11}")
    for r in rows:
        ov = [r.get(f"{c}_overhead_ms") for c in CLOCKS]
        ov = ["" if o is None else f"{o:9.3f}" for o in ov]
        print(f"{r['pp']:>2} {r['engine']:<22} {r['wall_ms']:8.3f} {ov[0]:>9} {r['cpu_ms']:8.3f} {ov[1]:>9} "
              f"{r['first_step_loss']:11.6f}{'' if r['loss_matches'] else ' MISMATCH'}")
    for g in goals:
        print(f"goal {g['goal']:<66} {g['value']:7.3f} {'met' if g['met'] else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
