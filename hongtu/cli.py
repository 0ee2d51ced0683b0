r"""The ``hongtu`` command.

Every mistake a user can fix ends as one line on stderr and exit code 2
(``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from pathlib import Path

from hongtu import __version__
from hongtu.errors import RANK_FAILURES, UserError, note_rank_failure

__all__ = ["main"]


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. train.epochs=3 engine.chunks=8")


class _CommandListFormatter(argparse.HelpFormatter):
    """Keeps each command and its description on one line of ``hongtu --help``.

    argparse measures the indented command names one indent short, so the
    longest name ('partition') would push its description to the next line.
    """

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.help is argparse.SUPPRESS or not hasattr(action, "_get_subactions"):
            return
        for sub in action._get_subactions():
            width = (len(self._format_action_invocation(sub)) + self._current_indent
                     + self._indent_increment)
            self._action_max_length = max(self._action_max_length, width)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hongtu",
        description="Out-of-core full-graph GNN training (HongTu). "
                    "Run 'hongtu COMMAND --help' for a command's options.",
        formatter_class=_CommandListFormatter)
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
    p.add_argument("--resume", action="store_true",
                   help="continue from output.dir/checkpoint.pt (also to extend a finished "
                        "run after raising train.epochs)")

    p = sub.add_parser("partition", parents=[common],
                       help="partition the graph and print the partition summary",
                       description="Run the 2-level partitioner of CONFIG (cached) and print "
                                   "edge balance, cut edges and replication factor.")
    _add_config(p)

    p = sub.add_parser("plot", parents=[common],
                       help="plot loss, accuracy and time per epoch from a metrics file",
                       description="Draw the loss, train/val/test accuracy and (when "
                                   "recorded) the per-epoch time split of a metrics file "
                                   "written by 'hongtu train --metrics'.")
    p.add_argument("metrics", metavar="METRICS", help="JSON-lines metrics file")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="image to write: .png, .pdf or .svg (default: METRICS with .png)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing image")

    p = sub.add_parser("predict", parents=[common],
                       help="run a trained model on the whole graph; save predictions",
                       description="Load a model.pt written by 'hongtu train', run it on "
                                   "the graph of CONFIG without dropout, and save one row "
                                   "per vertex in your original vertex order.")
    _add_config(p)
    p.add_argument("--checkpoint", metavar="PATH",
                   help="the model file (default: output.dir/model.pt of CONFIG)")
    p.add_argument("-o", "--output", metavar="OUT.npy", required=True,
                   help="where to save the array (.npy)")
    p.add_argument("--embeddings", action="store_true",
                   help="save the last hidden layer (float32, one row per vertex) instead of the "
                        "predicted class ids (int64, N)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")

    p = sub.add_parser("report", parents=[common],
                       help="communication-cost report: α, transfer volumes, bytes, memory",
                       description="Plan CONFIG on paper (no GPU, no training buffers): "
                                   "replication factor α per part count, transfer volumes "
                                   "with and without reorg, predicted bytes and cost per "
                                   "epoch, and device memory per chunk count.")
    _add_config(p)
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument("--plot", metavar="FILE", help="also draw the report to FILE (.png)")
    p.add_argument("--dump-plan", metavar="DIR",
                   help="also write partition.npz and plan.npz to the directory DIR")
    p.add_argument("--parts-list", metavar="2,4,...",
                   help="part counts of the α table (default 2,4,...,512)")
    p.add_argument("--alpha-seconds", metavar="S", default=None,
                   help="start no further part count of the α table once it has taken S "
                        "seconds (default 120; 0: every count; METIS on a large graph "
                        "takes minutes per count, cached for the next report)")
    p.add_argument("--chunks-list", metavar="4,8,...",
                   help="chunk counts to compare (default: n and about n/4, n/2, 2n, 4n)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing plot or plan files")

    p = sub.add_parser("calibrate", parents=[common],
                       help="measure this machine's transfer throughputs (GB/s)",
                       description="Measure host->device copies and row gathers, peer copies "
                                   "between GPUs and device-local gathers (CPU equivalents "
                                   "without CUDA); print them and write JSON that "
                                   "engine.throughput.*=auto reads.")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="JSON file to write (default .hongtu_cache/calibration.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing FILE")
    p.add_argument("--size", metavar="MiB", type=int, default=256,
                   help="MiB moved per measurement (default 256)")
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
    from hongtu.engine.checkpoint import CHECKPOINT, require_checkpoint
    from hongtu.engine.comm import in_distributed_launch
    from hongtu.engine.launch import check_devices, launch
    from hongtu.engine.trainer import Interrupted, Trainer, check_output_dir

    cfg = load_config(args.config, args.overrides)
    # Resuming continues the results already in output.dir: nothing is replaced.
    overwrite = args.overwrite or args.resume
    metrics = Path(args.metrics) if args.metrics else None
    if metrics and metrics.exists() and not overwrite:
        raise UserError(f"metrics file '{metrics}' already exists; pass --overwrite to "
                        "replace it, --resume to append to it, or choose another file")
    # What needs no graph is checked before the graph is loaded and planned.
    if args.resume:
        require_checkpoint(Path(cfg.output.dir))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        _check_can_create(Path(cfg.output.dir))
        if metrics:
            _check_writable(metrics)
    if cfg.engine.devices > 1 and not in_distributed_launch():
        check_devices(cfg.engine.accelerator, cfg.engine.devices)
        check_output_dir(Path(cfg.output.dir), overwrite)  # (before any rank starts)
        return launch(args.argv, cfg.engine.devices,
                      str(Path(cfg.output.dir) / CHECKPOINT), resumed=args.resume)
    out = (lambda s: None) if args.quiet or not rank0 else print
    trainer = Trainer(cfg, overwrite=overwrite, out=out)
    if metrics and rank0:
        metrics.parent.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            metrics.write_text("")
    out(f"preprocessing {trainer.preprocess_s:.2f} s")
    try:
        records = trainer.fit(args.metrics, progress=False if args.quiet else None,
                              resume=args.resume)
    except Interrupted as e:
        print(f"hongtu: {e}", file=sys.stderr)
        return 130
    trainer.close()
    if records and records[-1]["test_acc"] is not None:
        r = records[-1]
        out(f"done: epoch {r['epoch'] + 1}, final test accuracy {r['test_acc']:.4f}; "
            f"model saved to {trainer.outdir / 'model.pt'}")
    elif not records and args.resume:
        out(f"nothing to train: the checkpoint has {trainer.start_epoch} epoch(s) done and "
            f"train.epochs is {cfg.train.epochs}; raise train.epochs to train further")
    if in_distributed_launch() and not os.environ.get(RANK_FAILURES):
        # A rank of torchrun's own (hongtu's launcher takes its workers' return
        # values) leaves now that its files are closed and the group is gone:
        # a rank aborting in interpreter teardown ("terminate called without an
        # active exception", seen once under load) failed the whole launch and
        # left the other nodes at the launcher's exit barrier.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return 0


def _seconds(text: str, option: str) -> float:
    """A number of seconds, 0 or more, given to ``option``."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise UserError(f"{option} '{text}': give a number of seconds, 0 or more (0: no "
                        "limit), e.g. 300")
    return value


def _check_can_create(outdir: Path) -> None:
    """Fail before training where ``output.dir`` is a file or cannot be written;
    nothing is left behind."""
    from hongtu.plot import probe_directory

    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"output.dir '{outdir}' is a file, not a directory; set "
                        "output.dir to a directory (it is created if missing)")
    try:
        probe_directory(outdir)
    except OSError as exc:
        raise UserError(f"output.dir '{outdir}': cannot be created or written "
                        f"({' '.join(str(exc).split())}); check the path and its "
                        "permissions, or set output.dir elsewhere") from exc


def _check_writable(metrics: Path) -> None:
    """Fail before training where the metrics file cannot be written; nothing is
    created or truncated."""
    from hongtu.plot import probe_directory

    try:
        if metrics.is_dir():
            raise IsADirectoryError(f"'{metrics}' is a directory")
        if metrics.exists():
            with open(metrics, "a"):
                pass
        else:
            probe_directory(metrics.parent)
    except OSError as exc:
        raise UserError(f"metrics file '{metrics}': cannot be written "
                        f"({' '.join(str(exc).split())}); check the directory exists and is "
                        "writable, or choose another file") from exc


def _cmd_plot(args) -> int:
    from hongtu.plot import FORMATS, check_output, plot_metrics, read_metrics

    out = Path(args.output) if args.output else Path(args.metrics).with_suffix(".png")
    check_output(out, args.overwrite, FORMATS, "plot")
    records = read_metrics(args.metrics)
    plot_metrics(records, out, overwrite=args.overwrite, title=Path(args.metrics).name)
    print(f"plotted {len(records)} epoch(s) to {out}")
    return 0


def _cmd_predict(args) -> int:
    from hongtu.config import load_config
    from hongtu.plot import check_output
    from hongtu.predict import predict, save_array

    cfg = load_config(args.config, args.overrides)
    out = Path(args.output)
    check_output(out, args.overwrite, (".npy",), "result")
    checkpoint = args.checkpoint or str(Path(cfg.output.dir) / "model.pt")
    array, acc = predict(cfg, checkpoint, embeddings=args.embeddings)
    save_array(array, out, overwrite=args.overwrite)
    what = (f"embeddings {array.shape[0]} x {array.shape[1]}" if args.embeddings
            else f"class predictions for {array.shape[0]} vertices")
    scores = "  ".join(f"{s} {a:.4f}" for s, a in acc.items())
    print(f"{what} saved to {out}" + (f" (accuracy: {scores})" if scores else ""))
    return 0


def _cmd_report(args) -> int:
    import json

    from hongtu.config import load_config
    from hongtu.plot import FORMATS, check_output
    from hongtu.report import (
        build_report,
        check_dump_dir,
        dump_plan,
        format_report,
        parse_counts,
        plot_report,
    )

    cfg = load_config(args.config, args.overrides)
    parts_list = parse_counts(args.parts_list, "--parts-list")
    chunks_list = parse_counts(args.chunks_list, "--chunks-list")
    # Refuse outputs before minutes of planning, not after.
    if args.plot:
        check_output(Path(args.plot), args.overwrite, FORMATS, "plot")
    if args.dump_plan:
        check_dump_dir(Path(args.dump_plan), args.overwrite)
    limit = {} if args.alpha_seconds is None else {
        "alpha_seconds": _seconds(args.alpha_seconds, "--alpha-seconds")}
    rep = build_report(cfg, parts_list, chunks_list, **limit)
    print(json.dumps(rep.data, indent=2) if args.json else format_report(rep.data))
    done = []
    if args.plot:
        done.append(f"plot written to {plot_report(rep.data, args.plot, args.overwrite)}")
    if args.dump_plan:
        files = dump_plan(rep, args.dump_plan, args.overwrite)
        done.append("plan written to " + ", ".join(str(f) for f in files))
    for line in done:  # stderr keeps --json's stdout one document
        print(line, file=sys.stderr if args.json else sys.stdout)
    return 0


def _cmd_calibrate(args) -> int:
    from hongtu.calibrate import (
        calibrate,
        default_output,
        format_calibration,
        write_calibration,
    )
    from hongtu.plot import check_output

    out = Path(args.output) if args.output else default_output()
    check_output(out, args.overwrite, None, "calibration")
    result = calibrate(args.size)
    print(format_calibration(result))
    write_calibration(result, out, overwrite=args.overwrite)
    print(f"written to {out}; engine.throughput.* = auto reads it from "
          f"<engine.cache_dir>/calibration.json")
    return 0


_COMMANDS = {"train": _cmd_train, "partition": _cmd_partition, "plot": _cmd_plot,
             "predict": _cmd_predict, "report": _cmd_report, "calibrate": _cmd_calibrate}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hongtu`` console script."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to start ranks with
    # argparse stops filling 'overrides' at the first option, so key=value
    # after an option ('train CFG --overwrite train.epochs=3') lands here.
    if extra and hasattr(args, "overrides") and all(
            "=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    if int(os.environ.get("RANK", "0")) != 0 and not args.verbose:
        level = max(level, logging.WARNING)  # one voice: rank 0 logs for all
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except UserError as e:
        if args.debug:
            raise
        return _error(str(e), e.exit_code)
    except Exception as e:
        line = _out_of_memory(e, args.command)
        if line is None or args.debug:
            raise
        return _error(line, 2)
    except KeyboardInterrupt:
        if not note_rank_failure(130):  # (hongtu's launcher says what stopped)
            print("hongtu: interrupted", file=sys.stderr)
        return _end_rank(130)


def _error(line: str, code: int) -> int:
    """Print the one error line (a rank of ``hongtu train``'s launcher leaves it
    to the launcher, which prints it once for all ranks); ``code``."""
    if not note_rank_failure(code, line):
        print(f"hongtu: error: {_rank()}{line}", file=sys.stderr)
    return _end_rank(code)


def _end_rank(code: int) -> int:
    """``code``; a rank of several processes exits with it at once, without the
    interpreter's teardown, where NCCL's process group would add a warning of
    its own ("destroy_process_group() was not called before program exit") to
    the one line."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code


def _rank() -> str:
    """``rank R: `` in a run of several processes, else nothing."""
    return f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def _out_of_memory(e: BaseException, command: str) -> str | None:
    """The one line for a GPU out of memory (``None`` for any other error)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(e, torch.cuda.OutOfMemoryError):
        return None
    m = re.search(r"Tried to allocate ([\d.]+ \w+)", str(e))
    line = (f"out of GPU memory{f' (tried to allocate {m.group(1)})' if m else ''}: lower "
            "engine.device_memory to leave PyTorch's allocator room beside the budget on this "
            "GPU, and do not turn its expandable_segments off in PYTORCH_CUDA_ALLOC_CONF")
    if command == "train":
        line += "; add --resume to continue from the last checkpoint"
    return line


if __name__ == "__main__":
    sys.exit(main())
