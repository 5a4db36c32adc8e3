"""The release chains: every published version of every scenario, in one bare git repository.

A scenario's chain is the ref ``refs/reef/scenarios/<name>``; a release is a commit whose tree is the artifact plus
its manifest, published by compare-and-swap on the ref and never rewritten. One module per concept:

- ``manifest.py``  names (refs, manifest file), ``Manifest`` (what every write takes), ``Release``, ``Rejection``,
  ``FileEntry``
- ``objects.py``   reading git objects back without trusting them (a truncated loose object must not hang libgit2)
- ``repo.py``      the repository: created and opened durably, one handle per thread, the guarded ``read``
- ``reads.py``     heads, releases, files, checkouts, pending candidates, rejections
- ``content.py``   an artifact's files as blobs and a content tree; large files as LFS objects
- ``refs.py``      compare-and-swap ref updates under git's ref locks; stale locks; lost writes
- ``remote.py``    pushing every ref update to the chain remote first; ``follow`` (``daemon/chain_remote.py`` is
  the transport)
- ``recovery.py``  start-up recovery, ``find_damage`` (``reef doctor``), ``fsck``
- ``diff.py``      what changed between two releases
- ``pruning.py``   weights a retention policy removed: tombstones, which releases are pruned, ``prune``
- ``bundle.py``    a release holding an adapter, a harness and the evidence for both
- ``requires.py``  what a release needs to run (``tool:git``, ``agent:claude>=2.0`` ...), checked on this machine
- ``store.py``     ``ReleaseStore``: holds the parts above (composition, not mixins); publish, rollback, hold,
  promote, reject

What other packages use is re-exported here.
"""

from daemon.releases import bundle, requires
from daemon.releases.content import files_from_dir, lfs_pointer
from daemon.releases.manifest import (
    KINDS,
    MANIFEST,
    OPERATIONS,
    PENDING_REF,
    PROMOTED_REF,
    REJECTED_REF,
    REJECTION,
    SCENARIOS_REF,
    FileEntry,
    FileSource,
    Manifest,
    Rejection,
    Release,
)
from daemon.releases.objects import unsafe_name
from daemon.releases.recovery import Damage, find_damage
from daemon.releases.repo import DEFAULT_LFS_THRESHOLD
from daemon.releases.store import ReleaseStore

__all__ = [
    "DEFAULT_LFS_THRESHOLD",
    "KINDS",
    "MANIFEST",
    "OPERATIONS",
    "PENDING_REF",
    "PROMOTED_REF",
    "REJECTED_REF",
    "REJECTION",
    "SCENARIOS_REF",
    "Damage",
    "FileEntry",
    "FileSource",
    "Manifest",
    "Rejection",
    "Release",
    "ReleaseStore",
    "bundle",
    "files_from_dir",
    "find_damage",
    "lfs_pointer",
    "requires",
    "unsafe_name",
]
