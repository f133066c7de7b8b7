"""``vlm-readout audit``: the command over :mod:`core.dataset_audit` (its parser,
its launcher handling, Ctrl-C, ``run.json`` and the session record).

Building the parser does not import :mod:`core.dataset_audit` (numpy, and the
read-outs' registry): the ``--methods`` help is read from it only when shown."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from core.cli.args import add_answer_text_args, add_model_args, answer_text_request
from core.cli.loading import load_from_args
from core.errors import ReadoutError
from core.requests.audit import AuditRequest
from core.shell.arguments import LazyHelp, batch_size, positive_int, positive_share, probability
from core.shell.terminal import progress_bar

# ---------------------------------------------------------------- command


def run(args, load=load_from_args) -> int:
    started = time.time()
    # function-local: torch and the dataset audit (numpy) load when the command runs, not for --help
    import torch

    from core.dataset_audit import dist_env, format_number, gather, merge_shards, shard_chunks, summarize, write_outputs
    from core.files.atomic import check_output_folder, staged_writes

    request = AuditRequest(
        dataset=args.dataset,
        methods=args.methods,
        limit=args.limit,
        batch_size=args.batch_size,
        rollout_alpha=args.rollout_alpha,
        region_min_cover=args.region_min_cover,
        dla_top_k=args.dla_top_k,
        fill=args.fill,
        answer_text=args.answer_text,
        answer_token_index=args.token_index,
    )
    methods = request.readouts()
    check_output_folder(args.out)  # fail fast, before the model loads
    dataset = request.pairs_file()
    with progress_bar("dataset", quiet=args.quiet, messages=True) as progress:  # a million lines take seconds
        items = request.read_items(progress)
    answer_text_request(args)  # --answer-text and --token-index checked, each a line starting with its option
    if args.session:
        from core.session import check_session_file

        check_session_file(args.session)
    rank, world, local = dist_env()
    backend = None
    owned = False  # this call started the process group (and ends it)
    if world > 1:
        import torch.distributed as dist

        if args.device == "auto":
            raise ReadoutError(
                "--device auto spreads one model over every GPU; with several processes give each its own "
                "(--device cuda: rank r uses cuda:LOCAL_RANK)"
            )
        on_cuda = bool(args.device) and args.device.startswith("cuda")
        if on_cuda:
            if not torch.cuda.is_available():
                raise ReadoutError("--device cuda, but CUDA is not available")
            args.device = f"cuda:{local}"
            torch.cuda.set_device(local)
        backend = "nccl" if on_cuda else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend)
            owned = True
    try:
        loaded = load(args)
        n_mine = sum(len(c) for c in shard_chunks(len(items), args.batch_size, rank, world))
        with (
            progress_bar("audit", quiet=args.quiet or rank != 0, total=n_mine) as progress,
            cancel_on_sigint() as cancelled,
        ):
            shard = request.run_shard(loaded, items, rank=rank, world=world, progress=progress, cancel=cancelled)
        shards = [shard] if world == 1 else gather(shard, rank, world)
        if rank != 0:
            return 0
        merged = merge_shards(shards)
        if not merged.cancelled:
            check_some_succeeded(merged.records, items, dataset, args.out)  # else nothing is written
        run_params = request.run_parameters(loaded, len(items))
        # the files land together once the --session run is recorded: a failure leaves an earlier run's as they were
        with staged_writes() as staging:
            files = write_outputs(staging, args.out, merged, methods, run_params, request.options(), len(items))
            _stage_run_json(staging, args.out, started, world, backend, run_params, merged.cancelled, files)
            if args.session:  # one summary run per audit (per-sample numbers stay in samples.jsonl): core/session.py
                from core.session import record_into

                run = request.summary_run(loaded, merged, len(items), str(args.out))
                record_into(args.session, run, model=loaded, parameters=request.parameters())  # as the app records it
        s = summarize(merged.records, [], len(items), merged.cancelled)
        failed = f" (their errors: {Path(args.out) / 'summary.json'})" if s["n_errors"] else ""
        print(
            f"{s['n_samples']} samples: {s['n_ok']} ok, {s['n_errors']} failed{failed}; "
            f"accuracy {format_number(s['accuracy'])}; wrote {Path(args.out)}"
        )
        if merged.cancelled:
            print(
                "error: interrupted; the samples done so far were written (run.json: complete false)", file=sys.stderr
            )
            return 130
        return 0
    finally:
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()


def check_some_succeeded(records: list[dict], items, dataset: Path, out) -> None:
    """A run in which no sample succeeded is a failed run: one line naming the
    dataset file, how many failed and the first one's line and error, and
    nothing written to ``out`` (an earlier run's outputs stay as they were)."""
    if not records or any(r["status"] == "ok" for r in records):
        return
    first = min(records, key=lambda r: r["index"])
    item = items[first["index"]]
    error = str(first["error"]).removeprefix(f"{item.where}: ")  # a file's error names the line already
    raise ReadoutError(
        f"{dataset}: no sample succeeded ({len(records):,} of {len(records):,} failed; nothing written to {out}); "
        f"the first, line {item.line}: {error}"
    )


@contextmanager
def cancel_on_sigint():
    """Within the block, the first Ctrl-C asks the run to stop after the
    current batch (yields the ``cancel()`` callable); a second one interrupts
    at once. The previous handler comes back on exit."""
    state = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        yield lambda: state["stop"]
        return

    def handler(signum, frame):
        if state["stop"]:
            raise KeyboardInterrupt
        state["stop"] = True
        below_bar = "\n" if sys.stderr.isatty() else ""  # the bar is drawn on a terminal only (core/shell/terminal.py)
        print(f"{below_bar}warning: stopping after this batch (Ctrl-C again to abort)", file=sys.stderr)

    before = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: state["stop"]
    finally:
        signal.signal(signal.SIGINT, before)


def _stage_run_json(staging, out, started, world, backend, run_params: dict, cancelled: bool, files: list[str]) -> None:
    """``run.json``: how the run ran (processes, backend, the dtype and device of rank 0's model, libraries)."""
    import torch  # function-local: the versions of the run's libraries, read when it ends
    import transformers

    from core.dataset_audit import SCHEMA_VERSION

    doc = {
        "schema_version": SCHEMA_VERSION,
        "complete": not cancelled,
        "world_size": world,
        "backend": backend,
        "dtype": run_params["dtype"],
        "device": run_params["device"],
        "elapsed_s": round(time.time() - started, 3),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "files": files,
        "note": "the only output that may differ between a one-process and a sharded run",
    }
    staging.add(Path(out) / "run.json", (json.dumps(doc, indent=1) + "\n").encode())


def _methods_help() -> str:
    from core.dataset_audit import DEFAULT_METHODS, METHODS  # the registry: imports numpy

    return f"comma-separated read-outs (default {','.join(DEFAULT_METHODS)}; available: {', '.join(METHODS)})"


def add_command(subparsers, load=load_from_args) -> None:
    p = subparsers.add_parser(
        "audit", help="run read-outs over a dataset of image-question pairs; distributions and the audit table"
    )
    add_model_args(p)
    p.add_argument("--dataset", required=True, help="a JSONL of samples, or a folder with dataset.jsonl")
    p.add_argument("--methods", default=None, help=LazyHelp(_methods_help))
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--limit", type=positive_int, help="only the first N samples")
    p.add_argument("--batch-size", type=batch_size, default=8)
    p.add_argument("--rollout-alpha", type=probability, default=0.5, help="rollout: weight of attention vs identity")
    p.add_argument(
        "--region-min-cover", type=positive_share, default=0.25, help="token share a region must cover to hit"
    )
    p.add_argument("--dla-top-k", type=positive_int, default=10, help="DLA components written per sample")
    p.add_argument(
        "--fill",
        default="mean",
        choices=["mean", "constant", "blur", "noise", "inpaint"],
        help="counterfactual: how the target mask is filled",
    )
    p.add_argument(
        "--session",
        help="also record the run into this session file: one run (kind audit) with the summary and one audit "
        "row per method; the per-sample rows stay in the output folder",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_answer_text_args(p, from_generation=False)  # each item's own answer text: the dataset's field
    p.set_defaults(func=lambda a: run(a, load))
