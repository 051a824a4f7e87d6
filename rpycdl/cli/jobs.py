"""`rpycdl submit`, `jobs`, `logs`, `wait`, `result`, `cancel`, `delete`, `artifacts` and `download`:
detached jobs, and the history of every job in the hosts' ledgers (like sbatch, squeue/sacct, scancel;
Ray's job CLI), and what jobs left in the artifact store."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import dill

from rpycdl.cli import arrays
from rpycdl.cli.common import (
    EXIT_FAILED,
    EXIT_JOB_TIMEOUT,
    EXIT_QUEUE_TIMEOUT,
    EXIT_USAGE,
    Command,
    each_server,
    iso,
    report_unreached,
    server_flags,
    size_flags,
    table,
    working_dir_flag,
)
from rpycdl.client import ArrayJob, Job, connect, job
from rpycdl.client.detached import EXISTS
from rpycdl.client.displays import seconds, usage_cells
from rpycdl.defaults import UPLOAD_WAIT
from rpycdl.errors import ContainerError, InvalidRequestError, JobNotFinishedError, RpycdlError
from rpycdl.security.auth import Identity
from rpycdl.states import JobState, need_text, waiting_for
from rpycdl.units import format_duration, format_size, parse_duration

WAIT_EXIT_CODES = f"""exit codes (of wait, and of result once it has the job's outcome):
  0     the job succeeded
  N     a command's own exit code (128+N when signal N killed it)
  {EXIT_FAILED}     the job failed, was cancelled or was lost, or no server could be reached
  {EXIT_USAGE}     no server knows the job, or bad arguments
  {EXIT_QUEUE_TIMEOUT}    its GPUs were not granted within its queue timeout, or it has not ended yet (wait
        --timeout passed first; result --no-wait)
  {EXIT_JOB_TIMEOUT}   it ran past its timeout and was stopped"""

DOWNLOAD_EXIT_CODES = f"""exit codes:
  0     the files were downloaded
  {EXIT_FAILED}     the download failed, or no server could be reached
  {EXIT_USAGE}     no server knows the job, it has no uploaded artifacts, or bad arguments
  {EXIT_QUEUE_TIMEOUT}    its outputs were still uploading when --timeout passed: try again later"""


def add_commands(command: Command) -> None:
    """Add submit, jobs, logs, wait, result, cancel, delete, artifacts and download to the `rpycdl` parser."""
    _add_submit(command)
    _add_jobs(command)
    for name, text, description in (
            ("logs", "print a job's output, or follow it live", "Print a job's output from its first line (or its "
             "last --tail lines); with -f, then follow it live until the job ends, and exit with its exit code as "
             "wait does. Your job, or anyone's with an admin certificate."),
            ("wait", "wait for a job to end; exit with its exit code", "Wait until a job has ended, print how it "
             "ended, and exit with its exit code (see below)."),
            ("result", "print or save a job's returned value", "Print what a job returned (its exit code, for a "
             "command), or save it with --output, and exit as rpycdl wait does (below): with a command's exit code, "
             f"so non-zero for one that failed; for a job that raised, print its exception and exit with "
             f"{EXIT_FAILED}. Waits for the job to end unless --no-wait. An array: each element's value, one a line in "
             "index order (a failed one's empty, and named on stderr), or with --output their list."),
            ("cancel", "cancel a pending or running job", "Cancel a job that has not ended: your own job, or "
             "anyone's with an admin certificate. A waiting job leaves the queue; a running one is stopped."),
            ("delete", "remove a finished job's record, log and result", "Remove an ended job from the ledger, "
             "with its log and result (a job that has not ended is refused: cancel it first)."),
            ("artifacts", "list what a job left in its output directory, in the artifact store",
             "List a job's artifacts: the files it left in $RPYCDL_OUTPUT_DIR (rpycdl.output_dir()), uploaded to the "
             "site's artifact store when it ended. An upload that failed keeps them on the server and says why; "
             "--retry tries again."),
            ("download", "download a job's artifacts", "Download a job's artifacts into DEST (default: the current "
             "directory), keeping their names, through its server (the store's credentials stay there); a "
             "progress bar on a terminal. Right after the job's end its outputs are still uploading to the store: "
             "it says so on stderr and waits for them, up to --timeout.")):
        epilog = {"wait": WAIT_EXIT_CODES, "result": WAIT_EXIT_CODES, "download": DOWNLOAD_EXIT_CODES,
                  "logs": f"with -f, {WAIT_EXIT_CODES}"}.get(name)
        sub = command(name, text, description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("job", help="the job's id, or the name you gave it")
        if name == "download":
            sub.add_argument("dest", nargs="?", default=".", help="where the files go (default: here)")
            sub.add_argument("--pattern", default=None, metavar="GLOB", help="only names matching, such as '*.pt'")
            sub.add_argument("--timeout", type=float, default=UPLOAD_WAIT, metavar="SECONDS",
                             help="wait this long at most for outputs still uploading (default: %(default)g; exit "
                                  f"code {EXIT_QUEUE_TIMEOUT} after it)")
            sub.add_argument("--service", default=None, help="ask only servers of this service")
        else:
            sub.add_argument("service", nargs="?", default=None, help="ask only servers of this service")
        if name == "artifacts":
            sub.add_argument("--retry", action="store_true", help="upload again what a failed upload kept")
        if name == "logs":
            sub.add_argument("-f", "--follow", action="store_true", help="then follow the output until the job ends")
            sub.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N lines")
        if name == "wait":
            sub.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                             help=f"give up after this long (exit code {EXIT_QUEUE_TIMEOUT})")
        if name == "result":
            sub.add_argument("--no-wait", action="store_true",
                             help=f"do not wait: exit with {EXIT_QUEUE_TIMEOUT} if the job has not ended")
            sub.add_argument("-o", "--output", default=None, metavar="FILE",
                             help="save the value to FILE instead: bytes and str as they are, anything else "
                                  "pickled with dill (load it with dill.load)")
            sub.add_argument("--no-verify", action="store_true",
                             help="unpickle the result without checking that the job wrote it (its seal, made with "
                                  "the result key of the client that submitted it): for a job of another machine "
                                  "or account, or from before sealed results. It runs whatever code the result "
                                  "holds: only for a result you trust")
        server_flags(sub)


def _add_jobs(command: Command) -> None:
    """Add `rpycdl jobs`: the listing and its filters."""
    listing = command(
        "jobs", "list jobs: waiting, running, and the history",
        "List the jobs of the hosts of every server the registry knows (or of one service, or of the server at "
        "--host), newest first: the unfinished ones and those that ended in the last day, or with --all every "
        "job kept (--keep of the servers). Attached jobs (run_code, rpycdl run) are listed with the detached ones. "
        f"Exits with {EXIT_FAILED} if a server could not be reached (the others are shown all the same).")
    listing.add_argument("service", nargs="?", default=None, help="only servers of this service")
    listing.add_argument("--all", action="store_true", help="every job kept, not only the recent ones")
    listing.add_argument("--user", action="append", default=None, dest="users", metavar="USER",
                         help="only this user's jobs (repeat for more)")
    listing.add_argument("--state", action="append", default=None, dest="states", metavar="STATE",
                         type=str.upper, choices=[state.value for state in JobState],
                         help="only jobs in this state (repeat for more)")
    listing.add_argument("--since", default=None, metavar="DURATION",
                         help="the jobs submitted in the last DURATION, such as 2d or 12h, however long ago they "
                              "ended (instead of the recent ones)")
    listing.add_argument("--limit", type=int, default=None, metavar="N", help="at most N jobs (default 100; 0: all)")
    listing.add_argument("-l", "--long", action="store_true",
                         help="also what each ended job used: its peak memory (MEM), CPU time (CPU) and most "
                              "processes at once (PROCS), as its server measured them ('-': not measured)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.add_argument("--expand", action="store_true", help="an array's elements each on its row (else one row "
                         "per array, its counts by state)")
    server_flags(listing)


def _add_submit(command: Command) -> None:
    submit = command(
        "submit", "submit a command as a detached job, and return at once (like sbatch)",
        "Submit COMMAND to a server of SERVICE as a detached job: it waits for its GPUs in the same first-come-\n"
        "first-served queue as every job, runs in the server's working directory as the server's user, and\n"
        "runs to its end whatever happens to this terminal or to the server process. Prints its id (--quiet:\n"
        "only the id). Then: rpycdl logs -f ID, rpycdl wait ID, rpycdl result ID, rpycdl cancel ID.",
        usage="rpycdl submit SERVICE [options] -- COMMAND [ARG ...]",
        epilog="example: rpycdl submit pytorch --gpu-memory 6GiB --name lr-1e-3 -- python train.py --lr 1e-3",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    submit.add_argument("service", help="service to run on (pytorch, ...; deeplearning with --image)")
    size_flags(submit)
    working_dir_flag(submit)
    submit.add_argument("--name", default=None, help="a name to find the job by, unique among your unfinished jobs")
    submit.add_argument("--exists", choices=EXISTS, default="error",
                        help="if you have a job (with --array: an array) of that --name: refuse (error, the default), "
                             "print it and submit nothing (return: a command you can run again), or cancel it and "
                             "submit anew (replace)")
    submit.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="stop the job after this long")
    submit.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                        help="fail the job if its GPUs are not granted within this long")
    submit.add_argument("--after", default=None, metavar="KIND:JOB[,JOB]",
                        help="wait for other jobs first (ids, or names of yours; an array waits for every element, "
                             "NAME[3] names one; with --array, NAME[*]: each element after its peer of the same "
                             "index): ok: until each SUCCEEDED, notok: until each ended otherwise, any: until each "
                             "ended; if they end so that it never can, the job fails with DependencyError, never "
                             "having run")
    submit.add_argument("--retries", type=int, default=0, metavar="N",
                        help="requeue the job up to N times (0 to 100; default 0) if it is LOST (its server or node "
                             "died while it ran) or a signal rpycdl did not send killed it (the OOM killer, a kill); "
                             "each attempt keeps its id and output directory and reads its number in "
                             "$RPYCDL_ATTEMPT; never after a cancel, its --timeout or rpycdl's limits")
    submit.add_argument("--retry-on-failure", action="store_true",
                        help="with --retries: also requeue it when it fails by itself (exits with another code "
                             "than 0)")
    submit.add_argument("--image", default=None, help="run COMMAND in a container of this image (deeplearning only)")
    submit.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="with --image: a variable of the container (repeat for more)")
    submit.add_argument("--workdir", default=None, help="with --image: the container's working directory")
    submit.add_argument("-q", "--quiet", action="store_true", help="print only the job's id")
    arrays.add_flags(submit)
    server_flags(submit)


def _submit(args: argparse.Namespace) -> int:
    if not args.argv:
        raise InvalidRequestError("give the command after the service: rpycdl submit pytorch -- python train.py")
    env = dict(item.partition("=")[::2] for item in args.env)
    if (args.env or args.workdir) and not args.image:
        raise InvalidRequestError("--env and --workdir go with --image")
    if args.working_dir and args.image:
        raise InvalidRequestError("--working-dir goes without --image: a container job's files come with its image")
    if args.image and (args.after or args.retries or args.retry_on_failure):
        raise InvalidRequestError("--after, --retries and --retry-on-failure go without --image: a container job "
                                  "cannot wait for others or be requeued yet")
    if args.image and args.gpus is not None or args.image and args.gpu_memory is not None:
        raise InvalidRequestError("a container gets whole GPUs: use --ngpus with --image")
    if args.image and (args.memory is not None or args.cpus is not None or args.priority or args.keep_idle):
        raise InvalidRequestError("--memory, --cpus, --priority and --keep-idle go without --image: a container job is "
                                  "not fenced by rpycdl, waits at the default priority, and is not reclaimed idle")
    if args.array is not None and args.keep_idle:
        raise InvalidRequestError("--keep-idle goes without --array: an array's elements do not keep idle GPUs")
    target = {"host": args.host, "port": args.port} if args.host else {"service": args.service}
    with connect(**target, registry_address=args.registry, secret_file=args.secret_file, tls_cert=args.tls_cert,
                 tls_key=args.tls_key, tls_ca=args.tls_ca) as conn:
        options = {"gpus": args.gpus, "gpu_memory": args.gpu_memory, "name": args.name, "timeout": args.timeout,
                   "queue_timeout": args.queue_timeout, "working_dir": args.working_dir, "exists": args.exists,
                   "memory": args.memory, "cpus": args.cpus, "after": args.after, "retries": args.retries,
                   "retry_on_failure": args.retry_on_failure, "priority": args.priority}
        if args.array is not None:
            return arrays.submit(args, conn, options)
        options["idle_reclaim"] = not args.keep_idle
        if args.image:
            submitted = conn.root.submit_container(args.image, args.argv, 1 if args.ngpus is None else args.ngpus,
                                                   env=env or None, workdir=args.workdir, name=args.name,
                                                   timeout=args.timeout, queue_timeout=args.queue_timeout,
                                                   exists=args.exists)
        else:
            submitted = conn.root.submit_command(args.argv, args.ngpus, **options)
        if args.quiet:
            print(submitted.id)
        else:
            named = f" ({submitted.name})" if submitted.name else ""
            print(f"job {submitted.id}{named} submitted to {submitted.info['service']} on {conn.address[0]}:"
                  f"{conn.address[1]}: {submitted.status()}")
    return 0


def _jobs(args: argparse.Namespace) -> int:
    query = {"all": args.all, "users": args.users, "states": args.states, "limit": args.limit,
             "since": None if args.since is None else parse_duration(args.since)}
    results = each_server(args, "jobs", **{key: value for key, value in query.items() if value is not None})
    rows: dict[str, dict[str, Any]] = {}
    for _, answer in results:
        if not isinstance(answer, Exception):
            rows.update((row["job_id"], row) for row in answer)  # servers of one host share their jobs
    shown = arrays.grouped(sorted(rows.values(), key=lambda row: row["submitted"], reverse=True),
                           args.expand)[:args.limit or None]
    if args.json:
        print(json.dumps(shown, indent=2, default=iso))
    else:
        print(format_jobs(shown, long=args.long))
    return report_unreached(args, results)


def format_jobs(rows: list[dict[str, Any]], long: bool = False) -> str:
    """Jobs as a table (rows as conn.root.jobs() gives them: times as datetimes): id, name, state, owner,
    service, what they asked for, when, how long they waited and ran, with `long` their priority and what they used
    (peak memory, CPU time, most processes at once), and why they ended (or, waiting, what they wait behind); a WHY
    column where a waiting job's owner's limits hold it back (its `reason`)."""
    cells, why = [], any(row.get("reason") for row in rows)
    for row in rows:
        started, ended = row["started"], row["ended"]
        waited = format_duration(seconds(row["submitted"], started or ended) or 0.0)
        ran = format_duration(seconds(started, ended) or 0.0) if started else "-"
        info = waiting_for(row) or row.get("error") or (f"exit {row['exit_code']}" if row.get("exit_code") is not None
                                                        else "")
        if not row["detached"]:
            info = "attached" + (f" from {row['client']}" if "client" in row else "") + (f"; {info}" if info else "")
        user = Identity(row["user"], row["user_verified"]).label
        cells.append([row["job_id"], row.get("name") or "-", row["state"], user, row["service"],
                      need_text(row["ngpus"], row["share_bytes"]),
                      row["submitted"].strftime("%Y-%m-%d %H:%M"), waited, ran,
                      *([str(row.get("priority") or 0), *usage_cells(row), _attempt(row)] if long else []),
                      *([row.get("reason") or "-"] if why else []), info])
    header = ["ID", "NAME", "STATE", "USER", "SERVICE", "GPUS", "SUBMITTED", "WAITED", "RAN",
              *(["PRIO", "MEM", "CPU", "PROCS", "TRY"] if long else []), *(["WHY"] if why else []), "INFO"]
    widest = [None, 24, None, 24, 16] + [None] * (len(header) - 6 - why) + [80] * why + [100]
    return "\n".join(table(header, cells, widest=widest) + ([] if rows else ["(no jobs)"]))


def _attempt(row: dict[str, Any]) -> str:
    """Which attempt a job's row is, of how many its retries= allow ("2/4"; the attempt alone where its request is
    not shown: another user's job)."""
    attempt, request = row.get("attempt", 1), row.get("request")
    return f"{attempt}/{(request.get('retries') or 0) + 1}" if isinstance(request, dict) else str(attempt)


def _find(args: argparse.Namespace) -> Job | ArrayJob:
    return job(args.job, args.service, host=args.host, port=args.port if args.host else None,
               registry_address=args.registry, secret_file=args.secret_file, tls_cert=args.tls_cert,
               tls_key=args.tls_key, tls_ca=args.tls_ca)


def _logs(args: argparse.Namespace) -> int:
    if args.tail is not None and args.tail < 0:
        raise InvalidRequestError("--tail takes a number of lines, 0 or more")
    found = _find(args)
    if isinstance(found, ArrayJob):
        return arrays.logs(found, args.tail)
    for line in found.logs(follow=args.follow, tail=args.tail):
        sys.stdout.write(line)
        sys.stdout.flush()
    if not args.follow:
        return 0
    row = found.refresh()
    return wait_exit_code(row) if JobState(row["state"]).finished else EXIT_QUEUE_TIMEOUT


def _wait(args: argparse.Namespace) -> int:
    found = _find(args)
    if isinstance(found, ArrayJob):
        return arrays.wait(found, args.timeout)
    status = found.wait(args.timeout)
    print(f"job {found.id}: {status}", file=sys.stderr)
    if not status.finished:
        return EXIT_QUEUE_TIMEOUT
    return wait_exit_code(found.info)


def wait_exit_code(row: dict[str, Any]) -> int:
    """The exit code of `rpycdl wait` for a job that has ended (WAIT_EXIT_CODES)."""
    state, code = JobState(row["state"]), row.get("exit_code")
    if state is JobState.TIMED_OUT:
        return EXIT_JOB_TIMEOUT
    if row.get("error_type") == "QueueTimeoutError":
        return EXIT_QUEUE_TIMEOUT
    if code is not None and state in (JobState.SUCCEEDED, JobState.FAILED):
        return code if code >= 0 else 128 - code
    return 0 if state is JobState.SUCCEEDED else EXIT_FAILED


def _result(args: argparse.Namespace) -> int:
    found = _find(args)
    if isinstance(found, ArrayJob):
        return arrays.result(found, args.no_wait, not args.no_verify, args.output)
    try:
        value = found.result(wait=not args.no_wait, verify=not args.no_verify)
    except JobNotFinishedError as exc:
        print(f"rpycdl result: {exc}: wait for it with rpycdl wait {found.id}", file=sys.stderr)
        return EXIT_QUEUE_TIMEOUT
    except ContainerError as exc:  # a container's non-zero exit: its code, as wait exits
        print(f"rpycdl result: {exc}", file=sys.stderr)
        return wait_exit_code(_ended(found))
    except RpycdlError:
        raise
    except Exception as exc:  # the job's own exception: its traceback, then one line
        print(getattr(exc, "remote_traceback", "") or "", end="", file=sys.stderr)
        print(f"rpycdl result: job {found.id} raised {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.output:
        data = value if isinstance(value, bytes) else value.encode() if isinstance(value, str) else dill.dumps(value)
        Path(args.output).write_bytes(data)
        print(f"rpycdl result: job {found.id}'s value ({type(value).__name__}, {format_size(len(data))}) saved to "
              f"{args.output}", file=sys.stderr)
    elif isinstance(value, bytes):
        sys.stdout.buffer.write(value)
    else:
        print(value if isinstance(value, str) else repr(value))
    return wait_exit_code(_ended(found))  # a command's value is its exit code: non-zero, it failed


def _ended(found: Job) -> dict[str, Any]:
    """The row of a job known to have ended (its outcome came): the handle's, unless from before its end."""
    return found.info if JobState(found.info["state"]).finished else found.refresh()


def _cancel(args: argparse.Namespace) -> int:
    found = _find(args)
    if isinstance(found, ArrayJob):
        return arrays.cancel(found)
    before = found.info["state"]
    status = found.cancel()
    print(f"job {found.id} ({before}) on {found.info['server']}: "
          + (status.state.value if status.finished else f"cancel requested, {status.state.value} still"))
    return 0


def _delete(args: argparse.Namespace) -> int:
    found = _find(args)
    found.delete()
    print(f"job {found.id} deleted: its record, log and result")
    return 0


def _artifacts(args: argparse.Namespace) -> int:
    found = _find(args)
    entry = found.artifacts(retry=args.retry)
    where = f"{entry['store']}/{found.info['user']}/{found.id}/"
    print(f"job {found.id}: artifacts {entry['state']}" + (f" to {where}" if entry["state"] == "uploaded" else ""))
    for artifact in entry["files"]:
        print(f"  {format_size(artifact['size']):>10}  {artifact['name']}")
    if entry["error"]:
        print(f"rpycdl artifacts: {entry['error']}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _download(args: argparse.Namespace) -> int:
    found = _find(args)
    if isinstance(found, ArrayJob):
        return arrays.download(found, args.dest, args.pattern, args.timeout)
    entry = found.artifacts()
    if entry["state"] == "uploading":  # the job has just ended
        print(f"rpycdl download: job {found.id}'s outputs are still uploading to the artifact store: waiting for "
              f"them (up to {args.timeout:g} s)", file=sys.stderr, flush=True)
    written = found.download(args.dest, pattern=args.pattern, timeout=args.timeout)  # a bar on a terminal
    total = sum(path.stat().st_size for path in written)
    print(f"job {found.id}: {len(written)} file(s), {format_size(total)}, in {args.dest}")
    return 0


COMMANDS = {"submit": _submit, "jobs": _jobs, "logs": _logs, "wait": _wait, "result": _result, "cancel": _cancel,
            "delete": _delete, "artifacts": _artifacts, "download": _download}
