"""Where a job's journal lies, and opening it: `journal.location` (an object store URL as it is,
a local folder made absolute against the configuration file's folder), else `<run_dir>/journal`."""

from __future__ import annotations

import pathlib

from batchplane.core.config import JobSettings
from batchplane.core.object_storage import open_storage
from batchplane.core.storage import Storage

#: The journal's folder under the run folder, unless `journal.location` says otherwise.
JOURNAL_DIR = "journal"


def journal_location(job: JobSettings, run_dir: pathlib.Path) -> str:
    """Where the job's journal lies.

    Args:
        run_dir: The job's run folder (`run_dir`, or the one `batchplane up --run-dir` gives).
    """
    if job.journal.location is not None:
        return job.locate(job.journal.location)
    return str(pathlib.Path(run_dir).absolute() / JOURNAL_DIR)


def open_journal_storage(job: JobSettings, run_dir: pathlib.Path, *, check_writes: bool) -> Storage:
    """Opens the job's journal (see `journal_location`); a local folder is created if missing.

    Args:
        check_writes: For a producer: prove first that an object store honours conditional
            writes (`object_storage.check_conditional_puts`); consumers write marks through
            the manifest's put-if-absent too, so they check as well unless they only read.
    Raises:
        FailedPrecondition: The store cannot be opened or ignores conditional writes.
        Unavailable: The store cannot be reached.
    """
    return open_storage(journal_location(job, run_dir), check_writes=check_writes)
