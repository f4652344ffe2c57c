"""`Checkpoint`: a calibration's statistics and measurements on disk in `<out>.ckpt/`, so an interrupted run resumes.

Each file is keyed by everything that determines it; a rerun with the same settings loads what matches and recomputes
the rest, and a finished run deletes what it wrote (and only that: the folder's manifest lists it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kvcal.profile.capture import GramCollector
from kvcal.runtime.files import remove_stale_temps, write_file

logger = logging.getLogger(__name__)


class Checkpoint:
    """Per-pass statistics on disk, so an interrupted calibration loses at most the window in flight.

    The folder's manifest (`MANIFEST`) lists every file kvcal wrote there; `clear` deletes only those, and a folder
    without a manifest is refused (`check_folder`), so nothing of the user's is ever deleted.
    """

    MANIFEST = "kvcal-checkpoint.json"
    _KNOWN = ("random-tokens.safetensors", "calibration-text.safetensors", "policy-statistics.safetensors",
              "search.json")   # what checkpoint folders held before the manifest existed

    def __init__(self, folder: Path, key: str):
        self.folder, self.key = folder, key
        self.resumed: dict[str, int] = {}     # pass name -> windows loaded from an earlier, interrupted run

    @classmethod
    def check_folder(cls, folder: Path) -> None:
        """Refuse (ValueError) a `folder` that exists but was not made by kvcal; adopt an old one without manifest
        whose files are all checkpoint files."""
        if not (folder.exists() or folder.is_symlink()):
            return
        refuse = ValueError(f"`{folder}` exists and is not a kvcal checkpoint folder; move it away or pass another "
                            "`--out`")
        if folder.is_symlink() or not folder.is_dir():
            raise refuse
        if (folder / cls.MANIFEST).is_file():
            return
        entries = list(folder.iterdir())

        def known(name: str) -> bool:      # a checkpoint file, or the temporary file of a killed writer of one
            return name in cls._KNOWN or any(name.startswith(f".{k}.tmp-") for k in cls._KNOWN)

        if not entries or not all(known(p.name) and p.is_file() and not p.is_symlink() for p in entries):
            raise refuse
        cls._write_manifest(folder, list(cls._KNOWN))

    def _written(self) -> list[str]:
        """Names recorded in the manifest (plain file names only: a forged entry cannot reach outside the folder)."""
        try:
            names = json.loads((self.folder / self.MANIFEST).read_text()).get("files", [])
        except (OSError, ValueError, AttributeError):
            return []
        return [n for n in names if isinstance(n, str) and n and Path(n).name == n and n not in (".", "..")]

    @classmethod
    def _write_manifest(cls, folder: Path, names: list[str]) -> None:
        write_file(folder / cls.MANIFEST, json.dumps({"written_by": "kvcal calibrate", "files": sorted(set(names))}),
                   overwrite=True)

    def _record(self, name: str) -> None:
        """Create the folder if needed and list `name` in its manifest, before the file itself is written."""
        if not self.folder.is_dir():
            self.check_folder(self.folder)
            self.folder.mkdir(parents=True, exist_ok=True)     # another run on the same `--out` may make it first
        names = self._written()
        if name not in names:
            self._write_manifest(self.folder, [*names, name])

    def load(self, name: str, collector: GramCollector) -> int:
        from safetensors import safe_open

        path = self.folder / f"{name}.safetensors"
        if not path.is_file():
            return 0
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("key") != self.key:
                    return 0
                collector.load_state_dict({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
                self.resumed[name] = int(meta["done"])
                return self.resumed[name]
        except Exception as e:  # a checkpoint is only a cache: a bad one is recomputed
            logger.warning("ignoring unreadable checkpoint %s (%s)", path, e)
            return 0

    def save(self, name: str, collector: GramCollector, done: int) -> None:
        from safetensors.torch import save_file

        path = self.folder / f"{name}.safetensors"
        self._record(path.name)
        state = collector.state_dict()
        write_file(path, lambda tmp: save_file(state, str(tmp), metadata={"key": self.key, "done": str(done)}),
                   overwrite=True)

    def load_probes(self) -> dict:
        """Measurements of an interrupted run (settings key -> Fidelity as a dict)."""
        path = self.folder / "search.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        if data.get("key") != self.key or not isinstance(data.get("probes"), dict):
            return {}
        self.resumed["measurements"] = len(data["probes"])
        return data["probes"]

    def save_probes(self, memo: dict) -> None:
        path = self.folder / "search.json"
        self._record(path.name)
        write_file(path, json.dumps({"key": self.key, "probes": memo}), overwrite=True)

    def clear(self) -> None:
        """Delete the files this folder's manifest lists (and their temporary files), then the folder if empty."""
        if self.folder.is_symlink() or not (self.folder / self.MANIFEST).is_file():
            return
        for name in self._written():
            (self.folder / name).unlink(missing_ok=True)
            remove_stale_temps(self.folder / name)
        remove_stale_temps(self.folder / self.MANIFEST)
        (self.folder / self.MANIFEST).unlink()
        try:
            self.folder.rmdir()
        except OSError:
            logger.warning("left %s in place: it holds files kvcal did not write", self.folder)
