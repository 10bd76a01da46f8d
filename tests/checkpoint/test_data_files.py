"""Data-file fingerprints in a checkpoint (`megalign.checkpoint.data_files`): what a fingerprint hashes, which edits
count as a change, and the resume check's refusal naming the file (issue 32 item 4)."""
import hashlib
import json
import os

import pytest

from megalign.checkpoint import CheckpointManager, check_resume_data, data_file_changes, fingerprint_files
from megalign.checkpoint.data_files import fingerprint
from megalign.config import ConfigError

SMALL = dict(whole_bytes=16, blocks=3, block_bytes=10)
"""Thresholds small enough that a 100-byte file is sampled: blocks at 0, 45 and 90 (round(i * 90 / 2))."""


def _entry(path, **limits):
    return {"path": str(path), "files": {"": fingerprint(str(path), **limits)}}


def _changes(path, edit, **limits):
    before = {"data.path": _entry(path, **limits)}
    edit()
    return data_file_changes(before, {"data.path": _entry(path, **limits)})


def test_a_small_file_is_hashed_whole(tmp_path):
    data = b'{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'
    (tmp_path / "pairs.jsonl").write_bytes(data)
    fp = fingerprint(str(tmp_path / "pairs.jsonl"))
    assert fp["size"] == len(data) and fp["whole"]
    assert fp["sha256"] == hashlib.sha256(data).hexdigest()
    assert fp["mtime_ns"] == os.stat(tmp_path / "pairs.jsonl").st_mtime_ns


def test_a_large_file_is_hashed_by_evenly_spaced_blocks_first_and_last_included(tmp_path):
    data = bytes(range(100))
    (tmp_path / "big.parquet").write_bytes(data)
    fp = fingerprint(str(tmp_path / "big.parquet"), **SMALL)
    assert not fp["whole"] and fp["size"] == 100
    assert fp["sha256"] == hashlib.sha256(data[0:10] + data[45:55] + data[90:100]).hexdigest()


def test_an_edit_of_the_same_size_is_a_change_and_a_touch_of_a_small_file_is_not(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"chosen": "7", "rejected": "8"}\n')
    swapped = _changes(path, lambda: path.write_text('{"chosen": "8", "rejected": "7"}\n'))
    assert swapped == [("data.path", str(path), "content differs")]
    assert _changes(path, lambda: os.utime(path, ns=(0, 10**18))) == []  # touched: its whole content was compared


def test_a_large_file_is_changed_by_its_size_or_by_a_new_time_even_with_the_same_sampled_blocks(tmp_path):
    path = tmp_path / "big.parquet"
    path.write_bytes(bytes(100))
    grown = _changes(path, lambda: path.write_bytes(bytes(101)), **SMALL)
    assert grown == [("data.path", str(path), "size 100 -> 101 bytes")]  # zeros: the sampled blocks agree
    path.write_bytes(bytes(100))
    [(_, _, why)] = _changes(path, lambda: os.utime(path, ns=(0, 10**18)), **SMALL)
    assert why.startswith("modified since (its sampled blocks agree")


def test_a_folder_is_every_file_under_it(tmp_path):
    folder = tmp_path / "dataset"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "data-00000.arrow").write_bytes(b"rows")
    (folder / "dataset_dict.json").write_text("{}")
    before = fingerprint_files({"data.path": str(folder), "data.eval_path": None})
    assert list(before) == ["data.path"]  # a null path names no file
    assert sorted(before["data.path"]["files"]) == ["dataset_dict.json", "train/data-00000.arrow"]
    (folder / "train" / "data-00001.arrow").write_bytes(b"more")
    os.remove(folder / "dataset_dict.json")
    after = fingerprint_files({"data.path": str(folder)})
    assert data_file_changes(before, after) == [
        ("data.path", f"{folder}/dataset_dict.json", "it no longer exists"),
        ("data.path", f"{folder}/train/data-00001.arrow", "it is new")]


def test_a_missing_path_on_one_side_is_a_change(tmp_path):
    gone = fingerprint_files({"data.eval_path": str(tmp_path / "held_out.jsonl")})
    assert gone == {"data.eval_path": {"path": str(tmp_path / "held_out.jsonl"), "files": None}}
    (tmp_path / "held_out.jsonl").write_text("{}\n")
    there = fingerprint_files({"data.eval_path": str(tmp_path / "held_out.jsonl")})
    assert data_file_changes(gone, there) == [("data.eval_path", str(tmp_path / "held_out.jsonl"), "it is new")]
    assert data_file_changes(gone, gone) == []


def test_the_resume_check_refuses_naming_the_file_and_key_or_warns_when_allowed(tmp_path, caplog):
    path = tmp_path / "pairs.jsonl"
    path.write_text("a\n")
    saved = fingerprint_files({"data.path": str(path)})
    path.write_text("b\n")
    now = fingerprint_files({"data.path": str(path)})
    with pytest.raises(ConfigError, match=rf"data file '{path}' \(data\.path\) changed since ckpt was written: "
                                          rf"content differs\. Set resume_changes=allow") as err:
        check_resume_data(saved, now, allow=False, checkpoint="ckpt")
    assert err.value.key == "data.path"
    assert check_resume_data(saved, now, allow=True, checkpoint="ckpt") == ["data.path"]
    assert f"'{path}' (data.path)" in caplog.text
    assert check_resume_data(saved, saved, allow=False) == []
    assert check_resume_data(None, now, allow=False, checkpoint="old") == []  # a checkpoint from before: warned
    assert "old holds no data-file fingerprints" in caplog.text


def test_a_checkpoint_holds_the_fingerprints_it_was_saved_with(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    (tmp_path / "pairs.jsonl").write_text("a\n")
    prints = fingerprint_files({"data.path": str(tmp_path / "pairs.jsonl")})
    manager.save(1, {"progress": {"step": 1}}, data_files=prints)
    manager.save(2, {"progress": {"step": 2}})
    assert manager.saved_data_files(1) == prints and manager.saved_data_files(manager.path(1)) == prints
    assert manager.saved_data_files(2) is None
    assert manager.saved_state_names(2) == {"progress"}
    with open(os.path.join(manager.path(2), "data_files.json"), "w") as f:
        json.dump(["not", "a", "mapping"], f)
    with pytest.raises(ConfigError, match=r"step_00000002/data_files\.json' must hold a mapping, got list"):
        manager.saved_data_files(2)
