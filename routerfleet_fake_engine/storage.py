"""The fake engine's storage directory: the disk tier's content and the storage identity marker.

Identity is bound to the storage, never to the process (Mooncake's ``.mooncake_local_disk_segment_id``):
the marker ``.routerfleet_storage_id`` holds a random ``storage_id`` and an ``epoch``. It is created
exclusively (``O_EXCL``), so two processes sharing a directory agree on one identity. Rules at start:

* marker present: read it (a restart finds its own disk);
* no marker and no data: a new identity, epoch 0;
* no marker but data files: the data cannot be attributed to any identity, so it is discarded and a
  new identity is written (never adopt content nobody can vouch for).

The epoch moves when the content is invalidated (``bump_epoch``: an admin wipe), so a router holding
the old content under the same identity refuses it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path

from routerfleet_fake_engine.cache import CachedBlock
from routerfleet_fake_engine.hashing import Namespace

log = logging.getLogger(__name__)

MARKER = ".routerfleet_storage_id"


class StorageDir:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.storage_id, self.epoch = self._identity()

    def _data_files(self) -> list[Path]:
        return sorted(self.path.glob("disk-rank*.json"))

    def _identity(self) -> tuple[str, int]:
        marker = self.path / MARKER
        data = self._data_files()
        record = {"storage_id": secrets.token_hex(16), "epoch": 0}
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            body = json.loads(marker.read_text())
            return str(body["storage_id"]), int(body["epoch"])
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        if data:
            log.warning("storage %s had data but no identity marker: discarded it", self.path)
            for p in data:
                p.unlink()
        return record["storage_id"], record["epoch"]

    def bump_epoch(self) -> int:
        """The content is invalidated: a new epoch, written atomically."""
        self.epoch += 1
        tmp = self.path / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"storage_id": self.storage_id, "epoch": self.epoch}))
        os.replace(tmp, self.path / MARKER)
        return self.epoch

    def save(self, rank: int, blocks: list[CachedBlock]) -> None:
        rows = [
            [b.hash, b.parent, list(b.tokens), b.namespace.lora_name, b.namespace.cache_salt, b.index]
            for b in blocks
        ]
        tmp = self.path / f"disk-rank{rank}.json.tmp"
        tmp.write_text(json.dumps({"epoch": self.epoch, "blocks": rows}))
        os.replace(tmp, self.path / f"disk-rank{rank}.json")

    def load(self, rank: int) -> list[CachedBlock]:
        p = self.path / f"disk-rank{rank}.json"
        if not p.exists():
            return []
        body = json.loads(p.read_text())
        if body.get("epoch") != self.epoch:
            return []  # written under another epoch: invalidated content
        return [
            CachedBlock(h, parent, tuple(tokens), Namespace(lora, salt), index)
            for h, parent, tokens, lora, salt, index in body["blocks"]
        ]
