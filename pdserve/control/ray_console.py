"""Ray's own console lines go to a log file, not the terminal, for the CLI's commands that start or
join Ray (`up`, `serve`, `status`, `scale`, `down`, `tune`): its Python loggers' notices ("Token
authentication is enabled ... RAY_AUTH_MODE") and its C++ core's ("Failed to determine local IP via
external connectivity to: 8.8.8.8:53"), which say nothing a pdserve user acts on.

C++ writes to file descriptor 2, as do the processes Ray starts there: that descriptor is pointed at
the log file, and Python's sys.stderr is reopened on a copy of the terminal's, so that pdserve's
own lines and its errors still reach the terminal. Ray's Python logger writes to whatever
sys.stderr is when it emits: it is given the log file instead, once Ray is imported."""

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

LOG_ENV = "PDSERVE_RAY_LOG"  # where Ray's lines go; default: <tmp>/pdserve/ray-console.log
# Every command appends to one file: past this size the next command starts it afresh, the old
# lines kept once as FILE.1 (a file descriptor Ray's C++ writes to cannot be rotated under it).
MAX_BYTES = 16 << 20

_log_file = None  # the open log file, once diverted


def log_path() -> Path:
    return Path(os.environ.get(LOG_ENV) or Path(tempfile.gettempdir()) / "pdserve" / "ray-console.log")


def divert(command: str) -> Path | None:
    """Point descriptor 2 at the log file and sys.stderr at the terminal; once per process (the CLI's).
    None where the log file cannot be written: Ray's lines then stay on the terminal, as said there."""
    global _log_file
    path = log_path()
    if _log_file is not None:
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > MAX_BYTES:
            os.replace(path, path.with_name(path.name + ".1"))
        _log_file = open(path, "a", buffering=1)
    except OSError as e:
        print(f"[pdserve] Ray's own lines stay on the terminal: cannot write {path} ({e.strerror}); "
              f"{LOG_ENV}=FILE names another", file=sys.stderr, flush=True)
        return None
    _log_file.write(f"--- pdserve {command} (pid {os.getpid()}) {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    sys.stderr.flush()
    terminal = os.dup(2)
    os.dup2(_log_file.fileno(), 2)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, errors="backslashreplace")
    return path


def ray_logger_to_file() -> None:
    """Ray's Python logger, and the messages its GCS sends the driver, go to the log file (after
    `import ray`, before `ray.init`); nothing where `divert` was not called (pdserve's functions
    called in a test's process)."""
    if _log_file is None:
        return
    import ray._private.worker as ray_worker

    # The GCS's messages for the driver ("(raylet) The node ... has been marked dead", "A worker died
    # or was killed ...") are printed to sys.stdout by Ray's listener thread through this function
    # (with log_to_driver=False, its only caller); pdserve prints what it does about each (a replica
    # down and replaced). A Ray without it keeps printing them.
    if callable(getattr(ray_worker, "print_to_stdstream", None)):
        ray_worker.print_to_stdstream = _gcs_message_to_file
    logger = logging.getLogger("ray")
    for h in list(logger.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            logger.removeHandler(h)
            to_file = logging.StreamHandler(_log_file)
            to_file.setFormatter(h.formatter)
            to_file.setLevel(h.level)
            logger.addHandler(to_file)


def _gcs_message_to_file(data: dict, ignore_prefix: bool = False) -> None:
    for line in data.get("lines", []):
        _log_file.write(f"({data.get('pid', 'ray')}) {line}\n")
