"""The README's Python example: train the default pipeline (2 local ranks, interleaved 1F1B) from Python.

Run from the repository root: ``python tests/examples/readme_example.py [section.key=value ...]``.
"""
import sys

from engine import RankError, Trainer, load_config
from engine.training import ConfigError, launch_ranks


def main(config):
    with Trainer(config) as trainer:       # this rank's model chunks, optimizer, data, process groups
        trainer.load()                     # continue from the latest checkpoint in checkpoint.dir, if there is one
        trainer.train()                    # training.steps optimizer steps (evaluates and checkpoints as configured)
        val_loss = trainer.evaluate()      # forward-only schedule; the same value on every rank
        path = trainer.save()              # torch.distributed.checkpoint, written atomically
        trainer.load(path)                 # model, optimizer, LR schedule, data position, RNG
        if trainer.is_log_rank:
            print(f"step {trainer.step}: val loss {val_loss:.3f}, checkpoint {path}")


if __name__ == "__main__":
    config = load_config("configs/default.yaml", ["training.steps=30", "logging.run_dir=runs/readme", *sys.argv[1:]])
    try:
        launch_ranks(main, config)         # starts pipeline x data x tensor local ranks (gloo on CPU)
    except (RankError, ConfigError) as exc:  # one line: the rank that failed first and its cause, or the bad field
        sys.exit(f"error: {exc}")
