"""The one exception tree of Reef.

Every error that crosses a module boundary is a ``ReefError``. Each class carries the data a caller needs
(the scenario, the missing receipts, the expected and actual head) and knows its HTTP status and its ``type``
string; ``daemon/app.py`` turns them into provider-shaped or Reef-shaped error bodies, and ``reef_cli`` turns
them into one-line messages and exit codes. Nothing else maps errors. ``storage_error()`` says which ``OSError``
and SQLite errors are a full, failing or read-only disk (a ``StorageError``: 507, exit 6).

    ReefError                          500  internal_error
    ├── BadRequest                     400  invalid_request_error
    │   ├── InvalidName                400  (scenario / run names)
    │   ├── RecipeError                400  (a recipe that cannot load or does not implement the interface)
    │   ├── Unsupported                400  (what the engine cannot do: images for a text-only model)
    │   ├── BaseMismatch               400  (an adapter release whose base is not the scenario's base model)
    │   ├── ContextLengthExceeded      400  (prompt beyond the model's context)
    │   └── ModelUnavailable           400  (a model directory missing, truncated or not a model; a package to install)
    ├── Unauthorized                   401  authentication_error
    ├── Forbidden                      403  permission_error (a scoped token outside its scope)
    ├── NotFound                       404  not_found_error
    │   └── UnknownReceipts            404  (names the receipts)
    ├── Conflict                       409  conflict_error
    │   ├── ReportConflict             409  (same report_id, different body)
    │   ├── RecipeConflict             409  (scenario already bound to another recipe)
    │   ├── HeadMoved                  409  (compare-and-swap lost: expected vs actual head)
    │   ├── Unchanged                  409  (a candidate whose content equals its parent's: no release)
    │   ├── LockBusy                   409  (a ref lock stayed taken past the timeout: retry)
    │   ├── HarnessRefused             409  (a harness the harness policy refuses: names the file and the rule)
    │   ├── RequirementUnmet           409  (a release needs what this machine lacks: names the item and an offer)
    │   ├── WeightsPruned              409  (a release whose weights a retention policy removed: names one kept)
    │   └── LeaseLost                  409  (the training lease was taken over: this daemon no longer trains)
    ├── PayloadTooLarge                413  request_too_large
    ├── StorageError                   507  storage_error   (disk full, fsync failed: nothing acknowledged)
    │   └── RecordsUnavailable         503  storage_unavailable (the records database cannot be reached)
    ├── StoreTooNew                    500  store_too_new   (a record store written by a newer Reef: exit 10)
    ├── EngineError                    500  engine_error
    │   ├── StepFailed                 500  (a recipe's training step raised in the trainer worker)
    │   │   └── CapReached             500  (a step reached its scenario's spend cap on the way)
    │   ├── CheckFailed                500  (the held-out check could not run: the step fails, never passes)
    │   ├── UpstreamError              502  upstream_error
    │   └── UpstreamTimeout            504  timeout_error
    ├── RemoteRefused                  502  remote_error    (a chain remote refused a push or fetch: says why)
    │   └── RemoteReleaseRefused       502  (releases on the remote this daemon refuses to take in: says which)
    ├── Unavailable                    503  overloaded_error (draining, not ready)
    └── DaemonNotRunning               (CLI side: cannot reach the daemon)
"""

from __future__ import annotations

import errno
from typing import Any


class ReefError(Exception):
    """Base of every Reef error. ``status`` is the HTTP status, ``type`` the machine-readable kind."""

    status: int = 500
    type: str = "internal_error"
    exit_code: int = 1
    # the ``code`` of OpenAI's error shape where OpenAI's own API sends one clients act on (else ``type``)
    code: str | None = None

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self.data = data

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type, "message": self.message}
        body.update({k: v for k, v in self.data.items() if v is not None})
        return body


class BadRequest(ReefError):
    status = 400
    type = "invalid_request_error"
    exit_code = 2

    def __init__(self, message: str, *, param: str | None = None, **data: Any) -> None:
        super().__init__(message, param=param, **data)
        self.param = param


class InvalidName(BadRequest):
    pass


class RecipeError(BadRequest):
    """A recipe that cannot be used: unknown, fails to import, does not implement the interface."""

    def __init__(self, message: str, recipe: str) -> None:
        super().__init__(message, param="recipe", recipe=recipe)
        self.recipe = recipe


class Unsupported(BadRequest):
    pass


class BaseMismatch(BadRequest):
    """A LoRA adapter release whose base model (by content id) is not the one it would be served on."""

    def __init__(self, message: str, *, expected: str | None, actual: str | None, **data: Any) -> None:
        super().__init__(message, param="files", expected_base=expected, actual_base=actual, **data)
        self.expected = expected
        self.actual = actual


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"  # OpenAI's: Codex reads it as "out of room in the context window"

    def __init__(self, prompt_tokens: int, context_length: int, *, at_least: bool = False) -> None:
        super().__init__(
            f"prompt is too long: {'at least ' if at_least else ''}{prompt_tokens} tokens > {context_length} "
            "maximum context length",
            prompt_tokens=prompt_tokens,
            context_length=context_length,
        )


class ModelUnavailable(BadRequest):
    """A model that cannot be served: its directory is missing, truncated or not a model (``path``), or a package
    it is made from is not installed (``install`` says what to install). The daemon goes on serving its others."""

    def __init__(self, message: str, *, path: object = None, install: str | None = None) -> None:
        super().__init__(message, param="model", path=None if path is None else str(path), install=install)
        self.path = None if path is None else str(path)
        self.install = install


class Unauthorized(ReefError):
    status = 401
    type = "authentication_error"
    exit_code = 3


class Forbidden(ReefError):
    """A valid token that does not allow this request (a scoped token outside its scenario, ``daemon/scopes.py``)."""

    status = 403
    type = "permission_error"
    exit_code = 3


class NotFound(ReefError):
    status = 404
    type = "not_found_error"
    exit_code = 4


class UnknownReceipts(NotFound):
    def __init__(self, receipts: list[str], scenario: str | None = None) -> None:
        where = f" in scenario {scenario!r}" if scenario else ""
        super().__init__(f"unknown receipts{where}: {', '.join(receipts)}", receipts=receipts, scenario=scenario)
        self.receipts = receipts


class Conflict(ReefError):
    status = 409
    type = "conflict_error"
    exit_code = 5


class ReportConflict(Conflict):
    pass


class Forgotten(Conflict):
    def __init__(self, receipts: list[str]) -> None:
        super().__init__(f"forgotten receipts (reef records forget) take no new reports: {', '.join(receipts)}",
                         receipts=receipts)
        self.receipts = receipts


class Archived(Conflict):
    def __init__(self, scenario: str) -> None:
        super().__init__(f"scenario {scenario!r} is archived: its records and releases stay readable; "
                         f"reef scenarios unarchive {scenario} serves it again", scenario=scenario)


class RecipeConflict(Conflict):
    def __init__(self, scenario: str, bound: str, asked: str) -> None:
        super().__init__(
            f"scenario {scenario!r} is bound to recipe {bound!r}, not {asked!r}",
            scenario=scenario,
            bound_recipe=bound,
            asked_recipe=asked,
        )


class HeadMoved(Conflict):
    def __init__(self, scenario: str, expected: str | None, actual: str | None) -> None:
        super().__init__(
            f"release chain of {scenario!r} moved: expected head {expected}, actual head {actual}",
            scenario=scenario,
            expected_head=expected,
            actual_head=actual,
        )
        self.expected = expected
        self.actual = actual


class Unchanged(Conflict):
    """A candidate whose content equals its parent's: publishing it would make a release that changes nothing."""

    def __init__(self, scenario: str, content_id: str) -> None:
        super().__init__(f"the candidate for {scenario!r} has the same content as the head ({content_id}); "
                         "not published", scenario=scenario, content_id=content_id)


class HarnessRefused(Conflict):
    """A harness release that the harness policy (``daemon/harness_policy.py``) refuses to hand to an agent, roll
    back to or take in from a chain remote: ``findings`` name each file and rule."""


class RequirementUnmet(Conflict):
    """A release whose ``requires`` (``daemon/releases/requires.py``) are not met on this machine, refused to load,
    roll back to, promote or publish: ``requirement`` is the item, ``found`` what this machine has, ``offered`` the
    newest release of its chain that needs nothing more (None: none)."""

    def __init__(self, message: str, *, release_id: str | None, requirement: str, found: str,
                 offered: str | None) -> None:
        super().__init__(message, release_id=release_id, requirement=requirement, found=found, offered=offered)
        self.release_id = release_id
        self.requirement = requirement
        self.found = found
        self.offered = offered


class WeightsPruned(Conflict):
    """A release whose weights the retention policy removed (``daemon/retention.py``): it stays on the chain but
    cannot be loaded, rolled back to or promoted; ``offered`` is the newest release before its chain's head whose
    weights are kept (None: none)."""

    def __init__(self, message: str, *, release_id: str | None, offered: str | None = None) -> None:
        super().__init__(message, release_id=release_id, offered=offered)
        self.release_id = release_id
        self.offered = offered


class PayloadTooLarge(ReefError):
    status = 413
    type = "request_too_large"
    exit_code = 2


class StorageError(ReefError):
    status = 507
    type = "storage_error"
    exit_code = 6


class RecordsUnavailable(StorageError):
    """The records database (PostgreSQL) cannot be reached: nothing was stored, so nothing is acknowledged.
    A 503: the client may retry, and service resumes by itself once the database is back."""

    status = 503
    type = "storage_unavailable"
    exit_code = 7


class StoreTooNew(ReefError):
    """A record store whose schema is newer than this Reef knows: refused rather than misread."""

    type = "store_too_new"
    exit_code = 10

    def __init__(self, where: str, version: int, supported: int) -> None:
        super().__init__(
            f"the record store {where} has schema version {version}, newer than this Reef knows (up to "
            f"{supported}): upgrade Reef, or point it at another store", path=where, version=version,
            supported=supported)
        self.version = version
        self.supported = supported


# what a full, over-quota, failing or read-only disk raises (SQLite: SQLITE_FULL, SQLITE_IOERR, SQLITE_READONLY)
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
_STORAGE_SQLITE = frozenset({13, 10, 8})
_STORAGE_TEXT = ("No space left on device", "Disk quota exceeded", "Input/output error", "Read-only file system",
                 "File too large")


def storage_error(exc: BaseException, what: str) -> StorageError | None:
    """``exc`` as a ``StorageError`` saying ``what`` failed, when it is a storage failure (disk full, quota, I/O
    error, read-only file system); else None. libgit2's ``OSError`` often carries only the message, no errno."""
    code = getattr(exc, "sqlite_errorcode", None)
    if (
        (isinstance(exc, OSError) and (exc.errno in _STORAGE_ERRNOS or any(t in str(exc) for t in _STORAGE_TEXT)))
        or (isinstance(code, int) and (code & 0xFF) in _STORAGE_SQLITE)
    ):
        return StorageError(f"{what} failed: {exc}")
    return None


class EngineError(ReefError):
    status = 500
    type = "engine_error"


class StepFailed(EngineError):
    """A recipe's training step raised in the trainer worker; the message is the exception's, no traceback."""


class CapReached(StepFailed):
    """A step reached its scenario's learning-spend cap on the way (``daemon/spend.py``: a proposer's provider
    tokens for the day): written down as failed with the cap's message, never retried."""


class CheckFailed(EngineError):
    """The held-out check (``daemon/gating/heldout.py``) could not run (the engine down, a timeout): the step is
    written down as failed with the reason, never as passed."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the held-out check could not run: {reason}", reason=reason)


class UpstreamError(EngineError):
    status = 502
    type = "upstream_error"


class UpstreamTimeout(EngineError):
    status = 504
    type = "timeout_error"


class RemoteRefused(ReefError):
    """The release chain's git remote refused a push or a fetch (unreachable, no such repository, auth, a hook):
    nothing was published; the scenario keeps serving its head. A push refused because the remote's head moved
    is ``HeadMoved`` instead."""

    status = 502
    type = "remote_error"

    def __init__(self, remote: str, why: str) -> None:
        super().__init__(f"the chain remote {remote} refused: {why}; nothing was published", remote=remote,
                         reason=why)
        self.remote = remote
        self.why = why


class RemoteReleaseRefused(RemoteRefused):
    """Releases fetched from the chain remote that a follower refuses to take in (a path that would leave its
    directory, a content id that is not the release's tree, an object over the configured size bound): their
    refs stay where they were here and the daemon serves on; ``refused`` names each release, ``moved`` the refs of
    the same follow that passed and were taken in."""

    def __init__(self, remote: str, refused: list[str], moved: list[str]) -> None:
        why = "; ".join(refused)
        ReefError.__init__(self, f"the chain remote {remote} holds releases this daemon refuses to take in: {why}; "
                           "it keeps serving what it has", remote=remote, refused=refused)
        self.remote = remote
        self.why = why
        self.refused = refused
        self.moved = moved


class Unavailable(ReefError):
    status = 503
    type = "overloaded_error"
    exit_code = 7


class DaemonNotRunning(ReefError):
    status = 503
    type = "daemon_not_running"
    exit_code = 7


class LockBusy(Conflict):
    """A ref lock (``<ref>.lock``) stayed held by another writer for longer than the caller would wait.

    Nothing was changed; the caller may retry. A lock left behind by a killed process is cleared by
    ``ReleaseStore.recover()`` (and by a publisher that finds it old enough)."""

    def __init__(self, ref: str, path: str, waited_s: float) -> None:
        super().__init__(
            f"{ref} is locked by another writer ({path} held for more than {waited_s:.1f} s); nothing was changed",
            ref=ref,
            lock_path=path,
            waited_s=round(waited_s, 3),
        )
        self.ref = ref
        self.lock_path = path


class LeaseLost(Conflict):
    """A step's lease is no longer its caller's (another daemon took it over after it was not renewed)."""

    def __init__(self, name: str, holder: str | None, current: str | None) -> None:
        super().__init__(f"lease {name!r} is no longer held by {holder!r} (held by {current!r})", lease=name,
                         holder=holder, current_holder=current)


class AgentError(ReefError):
    """A coding agent could not be installed, found or started."""

    status = 500
    type = "agent_error"
    exit_code = 8
