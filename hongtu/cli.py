r"""The ``hongtu`` command.

Every mistake a user can fix ends as one line on stderr and exit code 2
(``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from hongtu import __version__
from hongtu.errors import UserError

__all__ = ["main"]


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. train.epochs=3 engine.chunks=8")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hongtu",
        description="Out-of-core full-graph GNN training (HongTu). "
                    "Run 'hongtu COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"hongtu {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    common.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    common.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", parents=[common],
                       help="train a GNN on the whole graph, chunk by chunk",
                       description="Train the model of CONFIG out of core.")
    _add_config(p)
    p.add_argument("--metrics", metavar="FILE", help="write one JSON line per epoch to FILE")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in output.dir")

    p = sub.add_parser("partition", parents=[common],
                       help="partition the graph and print the partition summary",
                       description="Run the 2-level partitioner of CONFIG (cached) and print "
                                   "edge balance, cut edges and replication factor.")
    _add_config(p)
    return parser


def _cmd_partition(args) -> int:
    from hongtu.config import load_config
    from hongtu.engine.trainer import load_data
    from hongtu.partition import format_stats, partition_graph, partition_stats

    cfg = load_config(args.config, args.overrides)
    e = cfg.engine
    t0 = time.perf_counter()
    graph = load_data(cfg)
    t_load = time.perf_counter() - t0
    parts = e.devices if e.parts == "auto" else e.parts
    chunks = 1 if e.chunks == "auto" else e.chunks
    t0 = time.perf_counter()
    part = partition_graph(graph, parts, chunks, method=e.partitioner, seed=cfg.train.seed,
                           cache_dir=e.cache_dir)
    t_part = time.perf_counter() - t0
    print(f"graph {graph.name}: {graph.num_nodes} vertices, {graph.num_edges} edges "
          f"(loaded in {t_load:.2f} s)")
    print(f"partition: {e.partitioner}, {parts} part(s) x {chunks} chunk(s) "
          f"in {t_part:.2f} s (cache: {e.cache_dir})")
    print(format_stats(partition_stats(graph, part)))
    return 0


def _cmd_train(args) -> int:
    from hongtu.config import load_config
    from hongtu.engine.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    if args.metrics and Path(args.metrics).exists() and not args.overwrite:
        raise UserError(f"metrics file '{args.metrics}' already exists; pass --overwrite to "
                        "replace it, or choose another file")
    trainer = Trainer(cfg, overwrite=args.overwrite)
    if args.metrics:
        Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
        Path(args.metrics).write_text("")
    print(f"preprocessing {trainer.preprocess_s:.2f} s")
    records = trainer.fit(args.metrics, progress=None if not args.quiet else False)
    if records and records[-1]["test_acc"] is not None:
        r = records[-1]
        print(f"done: {len(records)} epochs, final test accuracy {r['test_acc']:.4f}; "
              f"model saved to {trainer.outdir / 'model.pt'}")
    return 0


_COMMANDS = {"train": _cmd_train, "partition": _cmd_partition}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hongtu`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except UserError as e:
        if args.debug:
            raise
        print(f"hongtu: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("hongtu: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
