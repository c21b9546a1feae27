"""The ``pipecast`` command: ``pipecast schedule ...`` (plans), ``pipecast train ...`` (training runs),
``pipecast tune ...`` (pick the schedule), ``pipecast sample ...`` (text from a checkpoint) and
``pipecast export ...`` (a checkpoint as safetensors)."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that provides ``add_arguments(parser)`` and ``run(args) -> int``
COMMANDS = {
    "schedule": ("engine.plan.cli", "print a schedule's per-rank action grid and simulated bubble"),
    "train": ("engine.training.launch", "run a YAML-configured training job (spawns local ranks or joins torchrun)"),
    "tune": ("engine.training.tune.tuner", "measure a config's costs, rank every valid schedule by predicted step time and "
                                     "memory, optionally verify the best"),
    "sample": ("engine.training.sample", "generate text from a run's checkpoint (any pipeline layout, one process)"),
    "export": ("engine.training.export", "write a checkpoint's model: one safetensors file (+ its config), or a "
                                         "Hugging Face folder (--format hf)"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with every command-line error as one line, ``pipecast CMD: error: MESSAGE (pipecast CMD --help
    lists the options)``, exit status 2 -- no usage block above it (the subcommands' parsers are of this class
    too, and the ``schedule`` command reports its bad values through it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="pipecast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # import only the chosen command's module
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args, extra = parser.parse_known_args(argv)
    args.extra = extra
    if extra and args.command not in ("train", "tune"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args._run(args) or 0)


def entry() -> None:
    """The installed ``pipecast`` script: :func:`main`, then exit.  A process that joined a torchrun job ends with
    ``engine.runtime.spawn.exit_process`` (no interpreter finalization, where a thread still inside torch would
    abort a finished rank with SIGABRT); any other with ``sys.exit``."""
    code = main()
    if "torch.distributed" in sys.modules:
        from .training.launch import under_torchrun
        if under_torchrun():
            from .runtime.spawn import exit_process
            exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
