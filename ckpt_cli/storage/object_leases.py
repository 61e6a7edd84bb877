"""The temporaries of object-store outputs: who holds them, and removing a killed run's.

An output written to an object store goes up under a hidden prefix beside DEST
(`.NAME.ckpt-tmp-XXXXXXXXXXXX/`, see `output.py`) before it is copied into place. A run killed
outright (SIGKILL, a lost node) cannot remove it, and its unfinished multipart uploads stay
in the bucket, billed, for ever. A store has no `flock`, so a run says it is alive with a
lease: the object `.ckpt-lease` inside its prefix, written before anything else and rewritten
every `LEASE_REFRESH` seconds by a background thread while the run lasts. The lease names the
process and the machine (`machine_id`: the boot and the pid namespace, so a container's
process numbers are never judged from another's).

The next run writing the same DEST (`remove_dead_temporaries`) judges each hidden prefix
(`run_is_gone`): gone when its lease was written on this machine by a process that no longer
runs, or when its lease (or, without one, its newest object) is older than `LEASE_EXPIRY` by
the store's own clock (the time of this run's own lease), wherever it ran. Those prefixes are
removed and their multipart uploads aborted, and so are unfinished multipart uploads into DEST
itself (a server-side copy cut short) begun before this run, when no other run holds a lease.
Everything else is left alone: a live run's temporaries are never touched.

I/O: one listing of the prefixes beside DEST, one listing of each hidden prefix found, and on
S3 one `ListMultipartUploads` per 1,000 uploads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from .base import TMP_MARKER, is_staging_name
from .local import process_alive
from .remote_replies import listing_time, remote_failure

#: the lease object inside a run's hidden prefix
LEASE_NAME = ".ckpt-lease"
#: seconds between two writes of a lease by its run
LEASE_REFRESH = 60.0
#: seconds `Lease.stop` waits for a renewal in flight
LEASE_STOP_WAIT = 10.0
#: seconds the cleanup of an interrupted run waits for a lease write in flight (`Lease.remove_late`)
LEASE_LATE_WAIT = 5.0
#: a lease (or a prefix without one) this much older than the store's clock is a dead run's
LEASE_EXPIRY = 15 * 60.0
#: a run that writes objects in place (`sync` push) keeps its lease at DEST's root under
#: this name and a random tail
ROOT_LEASE_PREFIX = ".ckpt-lease-"
#: the random tail of a hidden prefix (`uuid4().hex[:12]`)
_TAIL = "[0-9a-f]{12}"


class ObjectStore(Protocol):
    """What leases need of a store: its fsspec filesystem and the prefix it stands for (`fs`,
    `root`), how it names a file to a user, and its writes. `remote.FsspecStorage` is one;
    this module never imports it, since that storage's `put` publishes under a lease."""

    fs: Any
    root: str
    display: str

    def describe(self, rel: str) -> str: ...

    def write_file(self, rel: str, chunks: Iterable[bytes]) -> int: ...

    def remove(self, rel: str) -> None: ...

    def s3_filesystem(self) -> Any | None: ...


def machine_id() -> str | None:
    """This machine and pid namespace (`BOOT_ID/pid:[INODE]`): two processes with the same id
    can judge each other's process numbers. None where it cannot be told (not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        space = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}/{space}" if boot else None


def run_is_gone(lease: dict[str, Any] | None, written: float | None, *, now: float) -> bool:
    """Whether the run whose hidden prefix this is has ended (its temporaries are debris).

    Args:
        lease: the prefix's lease as read (None: it has none).
        written: when the lease was last written (without a lease: the prefix's newest
            object), by the store's clock; None when the store dates nothing.
        now: the store's time now (when this run wrote its own lease).
    """
    here = machine_id()
    if lease is not None and here is not None and lease.get("machine") == here:
        pid = lease.get("pid")
        if isinstance(pid, int) and not process_alive(pid):
            return True
    # a process alive under that number, or on another machine: the renewals tell
    return written is not None and now - written > LEASE_EXPIRY


class Lease:
    """This run's lease, the object `rel` of `store`: written by `start`, rewritten every
    `LEASE_REFRESH` seconds until `stop` (which removes nothing: the caller does, with its
    prefix, then `remove_late`). `written_at`: when the store recorded the first write, by the
    store's clock (the `Date` of its reply, on S3), or None.

    Every write, the first one too, is made by the lease's own thread: a signal (Ctrl-C) that
    interrupts the caller's wait for it leaves the request to finish there, where its end is
    seen (`remove_late`), instead of in the store client's event loop, where it would land
    unseen after the cleanup."""

    def __init__(self, store: ObjectStore, rel: str):
        self.store = store
        self.rel = rel
        self.written_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first_written = threading.Event()
        self._first_error: BaseException | None = None
        #: whether a write was in flight when `stop` returned (it may land after the cleanup)
        self._late = False
        self.body = json.dumps(
            {
                "written_by": "ckpt",
                "pid": os.getpid(),
                "machine": machine_id(),
                "rule": "the lease of a running ckpt on its temporaries; another ckpt writing "
                f"the same destination removes them once it is {LEASE_EXPIRY:g} s old, or at "
                "once on the same machine when the process is gone",
            }
        ).encode()

    def start(self) -> None:
        """Write the lease, then keep it fresh in the background (the first write's failure is
        raised here)."""
        self._thread = threading.Thread(target=self._keep, name="ckpt-lease", daemon=True)
        self._thread.start()
        self._first_written.wait()
        if self._first_error is not None:
            raise self._first_error

    def _keep(self) -> None:
        try:
            self._write()
        except BaseException as error:  # raised by `start`, in the caller's thread
            self._first_error = error
            return
        finally:
            self._first_written.set()
        self._renew()

    def _write(self) -> None:
        s3 = self.store.s3_filesystem()
        if s3 is None:
            self.store.write_file(self.rel, [self.body])
            return
        # one PUT whose reply dates it by the store's clock (no HEAD to ask)
        bucket, key, _ = s3.split_path(f"{self.store.root}/{self.rel}")
        try:
            reply = s3.call_s3("put_object", Bucket=bucket, Key=key, Body=self.body)
        except Exception as exc:
            raise remote_failure(exc, self.store.describe(self.rel), writing=True) from None
        if self.written_at is None:
            self.written_at = _reply_date(reply)

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_REFRESH):
            with contextlib.suppress(Exception):  # a missed renewal: the next one may land
                self._write()

    def stop(self) -> None:
        """Stop renewing. A renewal in flight is waited for a little (so none lands after the
        removal), not here once a stop signal came (the caller removes its prefix first, then
        `remove_late` waits a few seconds for it and removes what it wrote; a lease that lands
        later still is the debris of a gone run, removed by the next one)."""
        from .. import faults

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=0 if faults.received is not None else LEASE_STOP_WAIT)
            self._late = self._thread.is_alive()

    def remove_late(self) -> None:
        """Once the caller removed its prefix after `stop`: wait `LEASE_LATE_WAIT` seconds at
        most for the write that was still in flight (a signal came while the store was slow
        to answer it), and remove the lease it wrote, which would otherwise outlive the run
        until the next run writing the same destination. Best effort: a write that takes
        longer is left to that next run."""
        if not self._late or self._thread is None:
            return
        self._thread.join(timeout=LEASE_LATE_WAIT)
        if self._thread.is_alive():
            return
        self._late = False
        self._delete()

    def release(self) -> None:
        """Stop renewing and remove the lease object, once a write still in flight is over
        (`remove_late`; best effort: one left behind is judged as any dead run's by the next
        run)."""
        self.stop()
        if self._late and self._thread is not None:
            self._thread.join(timeout=LEASE_LATE_WAIT)
            self._late = self._thread.is_alive()
        self._delete()

    def _delete(self) -> None:
        s3 = self.store.s3_filesystem()
        with contextlib.suppress(Exception):
            if s3 is None:
                self.store.remove(self.rel)
                return
            bucket, key, _ = s3.split_path(f"{self.store.root}/{self.rel}")
            s3.call_s3("delete_object", Bucket=bucket, Key=key)
            s3.invalidate_cache(f"{self.store.root}/{self.rel}")


def _reply_date(reply: Any) -> float | None:
    """The store's clock in a botocore reply (its `Date` header), or None."""
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(reply["ResponseMetadata"]["HTTPHeaders"]["date"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def is_lease(rel: str) -> bool:
    """Whether `rel` (a name under a destination) is a lease: never part of a checkpoint."""
    last = rel.rsplit("/", 1)[-1]
    return last == LEASE_NAME or last.startswith(ROOT_LEASE_PREFIX)


def root_lease_name() -> str:
    """A fresh name for the lease of a run that writes objects in place (`sync` push)."""
    import uuid

    return f"{ROOT_LEASE_PREFIX}{uuid.uuid4().hex[:12]}"


def abort_dead_uploads(
    store: ObjectStore,
    listing: dict[str, dict[str, Any]],
    lease: Lease,
    debris: Iterable[str] = (),
) -> list[str]:
    """For a run that writes objects in place under `store`'s root (`sync` push), its lease
    `lease` written: remove the root leases in `listing` (the round's listing of the root,
    name -> info) of runs that are gone, and, when no other run holds a live one, remove the
    objects of `debris` that `listing` holds (what such a run writes and removes again
    itself: a run killed meanwhile leaves them) and abort the unfinished multipart uploads
    under the root begun before this run (those under a hidden `.NAME.ckpt-tmp-*` prefix are
    another output's, judged by their own leases). S3 only (other stores have no multipart
    uploads to list). Returns what was done, for the user."""
    fs = store.s3_filesystem()
    if fs is None:
        return []
    now = lease.written_at or time.time()
    alive = False
    removed = 0
    for rel, info in listing.items():
        if "/" in rel or not rel.startswith(ROOT_LEASE_PREFIX) or rel == lease.rel:
            continue
        body: dict[str, Any] | None = None
        with contextlib.suppress(Exception):
            text = json.loads(fs.cat_file(f"{store.root}/{rel}"))
            body = text if isinstance(text, dict) else {}
        if not run_is_gone(body, listing_time(info), now=now):
            alive = True
            continue
        bucket, key, _ = fs.split_path(f"{store.root}/{rel}")
        with contextlib.suppress(Exception):
            fs.call_s3("delete_object", Bucket=bucket, Key=key)  # one request, no listing
            removed += 1
    notes = []
    if removed:
        notes.append(
            f"removed the lease{'s' if removed > 1 else ''} of {removed} killed "
            f"run{'s' if removed > 1 else ''} writing {store.display}"
        )
    if alive:
        return notes
    for rel in debris:
        if rel not in listing:
            continue
        bucket, key, _ = fs.split_path(f"{store.root}/{rel}")
        with contextlib.suppress(Exception):
            fs.call_s3("delete_object", Bucket=bucket, Key=key)
            notes.append(f"removed {store.describe(rel)}, left by a run that was killed")
    bucket, key, _ = fs.split_path(store.root)
    aborted = 0
    try:
        uploads = _list_uploads(fs, bucket, f"{key}/")
    except Exception:
        return notes
    for upload in uploads:
        target = str(upload.get("Key", ""))
        started = listing_time({"LastModified": upload.get("Initiated")})
        if any(is_staging_name(part) for part in target[len(key) + 1 :].split("/")):
            continue
        if started is None or started >= now:
            continue
        with contextlib.suppress(Exception):
            fs.call_s3(
                "abort_multipart_upload", Bucket=bucket, Key=target, UploadId=upload["UploadId"]
            )
            aborted += 1
    if aborted:
        notes.append(
            f"aborted {aborted} unfinished multipart upload{'s' if aborted > 1 else ''} "
            f"into {store.display} of a run that was killed"
        )
    return notes


def lease_time(store: ObjectStore, rel: str) -> float:
    """When the store recorded the lease `rel`, by its clock (else this machine's)."""
    return listing_time(store.fs.info(f"{store.root}/{rel}")) or time.time()


def remove_dead_temporaries(parent: ObjectStore, name: str, lease: Lease) -> list[str]:
    """Remove the hidden prefixes `.NAME.ckpt-tmp-*` in `parent` of runs that are gone (see
    the module docstring) and abort their unfinished multipart uploads, and those into DEST
    (`parent/NAME`) begun before this run when no other run holds a lease; `lease` is this
    run's, written in its own prefix. Returns what was done, for the user. Best effort: what
    cannot be listed or removed is left as it was."""
    fs = parent.fs
    pattern = re.compile(re.escape(f".{name}{TMP_MARKER}") + _TAIL)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(parent.root)
    own = lease.rel.split("/", 1)[0]
    try:
        now = lease.written_at or lease_time(parent, lease.rel)
        entries = [
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(parent.root, detail=True)
        ]
    except Exception:
        return []
    gone: list[str] = []
    alive = False
    seen = {e for e in entries if pattern.fullmatch(e)}
    for entry in sorted(seen):
        if entry == own or not pattern.fullmatch(entry):
            continue
        verdict = _judge(parent, entry, now)
        if verdict is None:
            continue
        if verdict:
            gone.append(entry)
        else:
            alive = True
    notes: list[str] = []
    for entry in gone:
        with contextlib.suppress(Exception):
            parent.remove(entry)
            notes.append(
                f"removed {parent.describe(entry)}/, the temporary objects of a run writing "
                f"{parent.describe(name)} that was killed"
            )
    with contextlib.suppress(Exception):
        fs.invalidate_cache(parent.root)  # the listing above must not answer for DEST later
    s3 = parent.s3_filesystem()
    if s3 is not None:
        aborted = _abort_uploads(parent, name, own, set(gone), seen, dest_too=not alive, now=now)
        if aborted:
            notes.append(
                f"aborted {aborted} unfinished multipart upload{'s' if aborted > 1 else ''} "
                f"of a killed run writing {parent.describe(name)}"
            )
    return notes


def _judge(parent: ObjectStore, entry: str, now: float) -> bool | None:
    """Whether the run of hidden prefix `entry` is gone (None: it cannot be told)."""
    fs = parent.fs
    try:
        found = fs.find(f"{parent.root}/{entry}", detail=True)
    except Exception:
        return None
    if not found:  # an object of that name rather than a prefix (or gone meanwhile)
        with contextlib.suppress(Exception):
            found = {f"{parent.root}/{entry}": fs.info(f"{parent.root}/{entry}")}
    lease: dict[str, Any] | None = None
    lease_time: float | None = None
    newest: float | None = None
    for path, info in found.items():
        stamp = listing_time(info)
        if stamp is not None:
            newest = stamp if newest is None else max(newest, stamp)
        if str(path).endswith(f"/{LEASE_NAME}"):
            lease_time = stamp
            with contextlib.suppress(Exception):
                text = json.loads(fs.cat_file(path))
                lease = text if isinstance(text, dict) else {}
    return run_is_gone(lease, lease_time if lease is not None else newest, now=now)


def _abort_uploads(
    parent: ObjectStore,
    name: str,
    own: str,
    gone: set[str],
    seen: set[str],
    *,
    dest_too: bool,
    now: float,
) -> int:
    """Abort the unfinished multipart uploads under the hidden prefixes in `gone`, under one
    that holds no object (not in `seen`: no lease, which a run writes before any upload)
    begun more than `LEASE_EXPIRY` ago, and (`dest_too`) into DEST begun before `now`.
    Returns how many were aborted."""
    fs = parent.fs
    bucket, key, _ = fs.split_path(f"{parent.root}/{name}")
    base = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
    aborted = 0
    for prefix in (f"{base}.{name}{TMP_MARKER}", key):
        try:
            uploads = _list_uploads(fs, bucket, prefix)
        except Exception:
            continue
        for upload in uploads:
            target = str(upload.get("Key", ""))
            started = listing_time({"LastModified": upload.get("Initiated")})
            if prefix == key:
                if not (target == key or target.startswith(f"{key}/")):
                    continue  # another output whose name begins with DEST's
                doomed = dest_too and started is not None and started < now
            else:
                entry = target[len(base) :].split("/", 1)[0]
                if entry == own:
                    continue
                doomed = entry in gone or (
                    entry not in seen and started is not None and now - started > LEASE_EXPIRY
                )
            if not doomed:
                continue
            with contextlib.suppress(Exception):
                fs.call_s3(
                    "abort_multipart_upload",
                    Bucket=bucket,
                    Key=target,
                    UploadId=upload["UploadId"],
                )
                aborted += 1
    return aborted


def _list_uploads(fs: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """Every unfinished multipart upload whose key begins with `prefix`."""
    found: list[dict[str, Any]] = []
    more: dict[str, str] = {}
    while True:
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **more)
        found.extend(page.get("Uploads", []))
        if not page.get("IsTruncated"):
            return found
        more = {
            "KeyMarker": str(page.get("NextKeyMarker", "")),
            "UploadIdMarker": str(page.get("NextUploadIdMarker", "")),
        }
