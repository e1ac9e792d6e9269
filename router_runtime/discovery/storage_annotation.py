"""Pod annotations -> an engine's storage identity: the pure half (no I/O; the fetch is in
``kubernetes.py``).

A deployer who knows which storage an engine pod keeps its host/disk KV blocks on says so on the pod,
under the key given by ``--k8s-storage-annotation`` (here ``routerfleet.io/storage-id``)::

    metadata:
      annotations:
        routerfleet.io/storage-id: "pv-node3-nvme0"     # the storage's id
        routerfleet.io/storage-id-epoch: "4"           # the key + "-epoch"; absent: epoch 0

The epoch moves when the storage's content is invalidated (wiped, reformatted), so a returning engine
with the same id but another epoch is not re-adopted (``kv/adoption.py``). One flag names both keys,
so the pair cannot be configured half-way. Readings:

* ``found``: an id of 1-253 printable ASCII characters without spaces, and an epoch that is absent
  or a decimal integer in [0, 2**63);
* ``absent``: neither annotation (the pod declares nothing: no identity, nothing wrong);
* ``malformed``: anything else (an empty or odd id, a bad epoch, an epoch without an id): no identity,
  never a guessed one.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..kv.adoption import StorageIdentity

EPOCH_SUFFIX = "-epoch"
MAX_EPOCH = 2**63 - 1

# Kubernetes' qualified name (apimachinery IsQualifiedName): [DNS-1123 subdomain "/"] name. Each is
# matched whole (fullmatch: "$" alone also matches before a trailing newline).
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_NAME_MAX = 63
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PREFIX_MAX = 253
_ID = re.compile(r"^[!-~]{1,253}$")  # printable ASCII, no spaces: it shows in logs and cap keys
_EPOCH = re.compile(r"^[0-9]{1,19}$")


class Result(enum.StrEnum):
    """How one pod's annotation was read (the ``result`` label of the metric). The first three come
    from the annotations themselves, the others from fetching the pod."""

    FOUND = "found"
    ABSENT = "absent"
    MALFORMED = "malformed"
    FORBIDDEN = "forbidden"  # 403: the router's Role lacks get on pods
    TIMEOUT = "timeout"  # not answered within the publication's bound
    ERROR = "error"  # any other failure: connection, HTTP error, pod gone or replaced


@dataclass(frozen=True, slots=True)
class Reading:
    result: Result
    identity: StorageIdentity | None = None
    why: str = ""  # for the log line; never the annotation's value


def validate_annotation_key(key: str) -> str:
    """``key`` if it is a Kubernetes annotation key whose epoch key (key + "-epoch") is one too;
    else ValueError saying why."""
    prefix, slash, name = key.rpartition("/")
    if slash and not prefix:
        raise ValueError(f"{key!r}: empty prefix before '/'")
    if "/" in prefix:
        raise ValueError(f"{key!r}: at most one '/' (an optional DNS prefix, then a name)")
    # The API server validates annotation keys lowercased, so an upper-case prefix is accepted.
    if prefix and (len(prefix) > _PREFIX_MAX or not _PREFIX.fullmatch(prefix.lower())):
        raise ValueError(f"{key!r}: the prefix must be a DNS subdomain of at most {_PREFIX_MAX} chars")
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"{key!r}: the name must be alphanumerics, '-', '_' or '.', starting and ending alphanumeric"
        )
    if len(name) + len(EPOCH_SUFFIX) > _NAME_MAX:
        raise ValueError(
            f"{key!r}: the name may have at most {_NAME_MAX - len(EPOCH_SUFFIX)} chars "
            f"(the epoch key adds {EPOCH_SUFFIX!r})"
        )
    return key


def epoch_key(key: str) -> str:
    return key + EPOCH_SUFFIX


def read_storage_annotation(annotations: Mapping[str, Any] | None, key: str) -> Reading:
    """The storage identity declared by a pod's ``metadata.annotations`` under ``key`` (see above)."""
    annotations = annotations if isinstance(annotations, Mapping) else {}
    sid, epoch = annotations.get(key), annotations.get(epoch_key(key))
    if sid is None and epoch is None:
        return Reading(Result.ABSENT)
    if sid is None:
        return Reading(Result.MALFORMED, why=f"{epoch_key(key)} without {key}")
    if not isinstance(sid, str) or not _ID.fullmatch(sid):
        return Reading(Result.MALFORMED, why=f"{key} is not 1-253 printable ASCII characters without spaces")
    if epoch is None:
        return Reading(Result.FOUND, StorageIdentity(sid, 0))
    text = epoch.strip() if isinstance(epoch, str) else ""
    if not _EPOCH.fullmatch(text) or int(text) > MAX_EPOCH:
        return Reading(Result.MALFORMED, why=f"{epoch_key(key)} is not an integer in [0, 2**63)")
    return Reading(Result.FOUND, StorageIdentity(sid, int(text)))


def read_pod_storage(pod: Mapping[str, Any], key: str, uid: str) -> Reading:
    """``read_storage_annotation`` of a pod object (or its PartialObjectMetadata) fetched for the
    incarnation ``uid``. A pod of another UID under the same name is another incarnation: its
    annotations say nothing about ours."""
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    if not isinstance(meta, Mapping):
        return Reading(Result.ERROR, why="the pod has no metadata")
    if meta.get("uid") != uid:
        return Reading(Result.ERROR, why="the pod was replaced (another UID under its name)")
    return read_storage_annotation(meta.get("annotations"), key)
