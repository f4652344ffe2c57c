"""The one guarded writer (`kvcal.runtime.files.write_file`, `write_folder`): never through a link, temp file and
rename, exclusive create unless overwrite, nothing left behind on an error, and a folder's earlier files removed only
when it listed them."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from conftest import read_only_folder

from kvcal.runtime.files import UnsafePathError, check_writable, write_file, write_folder


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


def test_write_file_writes_bytes_text_and_callables(tmp_path):
    assert write_file(tmp_path / "a.bin", b"\x00\x01", overwrite=False).read_bytes() == b"\x00\x01"
    assert (write_file(tmp_path / "b.txt", "é", overwrite=False)).read_text(encoding="utf-8") == "é"
    write_file(tmp_path / "c.png", lambda tmp: Path(tmp).write_bytes(b"png"), overwrite=False)
    assert (tmp_path / "c.png").read_bytes() == b"png"
    write_file(tmp_path / "new" / "d.txt", "x", overwrite=False)              # the folder is made
    assert (tmp_path / "new" / "d.txt").read_text() == "x" and _temps(tmp_path) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_write_file_never_writes_through_a_link(tmp_path, overwrite):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    link = tmp_path / "b.kvcal.report.json"
    link.symlink_to(weights)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        write_file(link, "{}", overwrite=overwrite)
    dangling = tmp_path / "gone.md"
    dangling.symlink_to(tmp_path / "nowhere" / "x.md")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        write_file(dangling, "#", overwrite=overwrite)
    assert weights.read_bytes() == b"weights" and link.is_symlink() and not (tmp_path / "nowhere").exists()
    assert _temps(tmp_path) == []


def test_a_link_made_while_writing_is_not_followed(tmp_path):
    target = tmp_path / "mine.txt"
    target.write_text("user")
    out = tmp_path / "report.md"

    def plant(tmp):
        Path(tmp).write_text("report")
        out.symlink_to(target)                 # someone puts a link at the name while the file is written

    with pytest.raises(UnsafePathError, match="symbolic link"):
        write_file(out, plant, overwrite=True)
    assert target.read_text() == "user" and out.is_symlink() and _temps(tmp_path) == []


def test_write_file_creates_exclusively_unless_overwrite(tmp_path):
    out = tmp_path / "bench.md"
    out.write_text("user's")
    with pytest.raises(FileExistsError, match="pass `--overwrite`"):
        write_file(out, "report", overwrite=False)
    assert out.read_text() == "user's"
    write_file(out, "report", overwrite=True)
    assert out.read_text() == "report" and _temps(tmp_path) == []
    with pytest.raises(UnsafePathError, match="is a folder"):
        write_file(tmp_path, "x", overwrite=True)


def test_of_two_writers_racing_exactly_one_wins(tmp_path):
    """The other writer creates the name after this one's check: the final rename does not replace it."""
    out = tmp_path / "b.kvcal.safetensors"

    def other_run_finishes_first(tmp):
        Path(tmp).write_bytes(b"mine")
        out.write_bytes(b"theirs")

    with pytest.raises(FileExistsError, match="already exists"):
        write_file(out, other_run_finishes_first, overwrite=False)
    assert out.read_bytes() == b"theirs" and _temps(tmp_path) == []
    assert "Errno" not in str(_raised(out))          # the message alone: the CLI prints it as one plain line


def _raised(out: Path) -> Exception:
    try:
        write_file(out, b"x", overwrite=False)
    except FileExistsError as e:
        return e
    raise AssertionError("not refused")


def test_exclusive_create_without_hard_links(tmp_path, monkeypatch):
    """On a file system without hard links the name is claimed with O_EXCL instead."""
    def no_links(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "x.json"
    write_file(out, "1", overwrite=False)
    assert out.read_text() == "1"

    def racer(tmp):
        Path(tmp).write_text("2")
        out.with_name("y.json").write_text("theirs")

    with pytest.raises(FileExistsError):
        write_file(out.with_name("y.json"), racer, overwrite=False)
    assert out.with_name("y.json").read_text() == "theirs" and _temps(tmp_path) == []


def test_an_error_while_writing_leaves_the_old_file_and_no_temp(tmp_path):
    out = tmp_path / "b.kvcal.safetensors"
    out.write_bytes(b"old")

    def dies(tmp):
        Path(tmp).write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_file(out, dies, overwrite=True)
    with pytest.raises(RuntimeError):
        write_file(tmp_path / "new.json", lambda tmp: (_ for _ in ()).throw(RuntimeError("disk full")),
                   overwrite=False)
    assert out.read_bytes() == b"old" and not (tmp_path / "new.json").exists() and _temps(tmp_path) == []


def test_check_writable_refuses_a_read_only_folder(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    check_writable(ro / "not" / "yet")                    # tried where it will be made
    try:
        read_only_folder(ro, monkeypatch)
        with pytest.raises(UnsafePathError, match=f"cannot write in `{ro}` \\(Permission denied\\)"):
            check_writable(ro / "sub")
    finally:
        monkeypatch.undo()
        ro.chmod(0o755)
    assert list(ro.iterdir()) == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(UnsafePathError, match="is a file, not a folder"):
        check_writable(tmp_path / "f" / "sub")


def test_write_folder_replaces_only_what_it_listed(tmp_path):
    out = tmp_path / "export"
    with write_folder(out, overwrite=False, listing=".list.json") as tmp:
        (tmp / "a.json").write_text("1")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"2")
    assert json.loads((out / ".list.json").read_text())["files"] == ["a.json", "sub/b.bin"]
    with pytest.raises(FileExistsError, match="pass `--overwrite`"):
        with write_folder(out, overwrite=False, listing=".list.json"):
            pass
    (out / "sub" / "thesis.tex").write_text("years of work")            # the user's, in the export folder
    with pytest.raises(FileExistsError, match="`sub/thesis.tex`, which kvcal did not write"):
        with write_folder(out, overwrite=True, listing=".list.json"):
            raise AssertionError("refused before the block runs")
    assert (out / "sub" / "thesis.tex").read_text() == "years of work" and (out / "a.json").is_file()
    (out / "sub" / "thesis.tex").unlink()
    with write_folder(out, overwrite=True, listing=".list.json") as tmp:
        (tmp / "c.json").write_text("3")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [".list.json", "c.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]    # no temporary or old folder left
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not written by kvcal"):
        with write_folder(mine, overwrite=True, listing=".list.json"):
            pass
    assert (mine / "notes.txt").read_text() == "keep"
