"""The kept calibrations: one JSON file per host, written whole and atomically under a lock (two queues at once
lose nothing); a file it cannot read is set aside, never trusted. docs/calibration.md, 'Where it is kept'."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from .fingerprint import kin_id
from .search import CalibrationResult

FORMAT, FORMAT_VERSION = "tome-patch calibrations", 1
# A file of the user's choosing, read by the hosts without a user folder of their own for it (WebUI, diffusers).
FILE_ENV = "TOME_PATCH_CALIBRATIONS"
log = logging.getLogger("tome_patch")


class SetAsideError(RuntimeError):
    """The file was not one this version reads; it was renamed, and this job runs the default."""


class KeptCalibrations:
    """``get(key_id)`` the kept result or None; ``put(key_id, key, result, record)`` adds one entry."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lock = FileLock(str(self.path) + ".lock", timeout=60)

    def _read(self) -> dict:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format {data.get('format')!r} version {data.get('format_version')!r}")
            entries = data["entries"]
            if not isinstance(entries, dict):
                raise ValueError("no entries")
            return entries
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            aside = self.path.with_name(f"{self.path.name}.set-aside-{int(time.time())}")
            os.replace(self.path, aside)
            log.warning("ToMe calibration: %s is not a file this version reads (%s); set aside as %s.",
                        self.path, err, aside.name)  # fmt: skip
            raise SetAsideError(str(err)) from err

    def get(self, key_id: str) -> CalibrationResult | None:
        with self.lock:
            entry = self._read().get(key_id)
        if entry is None:
            return None
        try:
            return CalibrationResult.from_dict(entry["result"])
        except (KeyError, TypeError, ValueError, IndexError):
            return None

    def nearest(self, key: dict, steps: int) -> CalibrationResult | None:
        """The plan kept for the same job at the nearest other step count (``fingerprint.kin_id``), or None: only a
        place for a calibration to start (``Calibration.start_from``), never used unchecked."""
        kin = kin_id(key)
        try:
            with self.lock:
                entries = self._read()
        except SetAsideError:
            return None
        found = []
        for entry in entries.values():
            try:
                if entry.get("kin") != kin:
                    continue
                result = CalibrationResult.from_dict(entry["result"])
            except (AttributeError, KeyError, TypeError, ValueError, IndexError):
                continue
            if result.steps != steps and result.kept:
                found.append((abs(result.steps - steps), result.steps, result))
        return min(found, key=lambda item: item[:2])[2] if found else None

    def put(self, key_id: str, key: dict, result: CalibrationResult, record: dict | None = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            try:
                entries = self._read()
            except SetAsideError:
                entries = {}
            entries[key_id] = {"key": key, "kin": kin_id(key), "result": result.as_dict(), **(record or {})}
            data = {"format": FORMAT, "format_version": FORMAT_VERSION, "entries": entries}
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(handle, "w", encoding="utf-8") as file:
                    json.dump(data, file, indent=1, sort_keys=True)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temporary, self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
