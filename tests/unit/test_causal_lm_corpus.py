"""The causal-lm corpus: files indexed by offset, records read and tokenised on demand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from fedgpu.node.data import DataDirError  # noqa: E402
from fedgpu.node.tasks.causal_lm import corpus  # noqa: E402
from fedgpu.node.tasks.causal_lm.adapters import load_tokenizer  # noqa: E402
from fedgpu.node.tasks.causal_lm.settings import parse  # noqa: E402


def _texts(ds: corpus.TextDataset) -> list[str]:
    return [ds.text(i) for i in range(len(ds))]


def test_blank_lines_crlf_and_both_formats(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_bytes(b"a b\n\n   \r\nc d\r\n\n\ne")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "more.jsonl").write_text(
        json.dumps({"text": "from json", "id": 1}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    train, test = corpus.splits(tmp_path, eval_fraction=0.1)
    assert _texts(corpus.TextDataset(train, None, 8, "text")) == [
        "a b", "c d", "e", "from json", "two"]
    assert _texts(corpus.TextDataset(test, None, 8, "text")) == ["held out"]


def test_without_a_test_split_every_nth_record_is_held_out(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("".join(f"r{i}\n" for i in range(20)))
    train, test = corpus.splits(tmp_path, eval_fraction=0.25)
    assert _texts(corpus.TextDataset(test, None, 8, "text")) == ["r3", "r7", "r11", "r15", "r19"]
    assert len(train) == 15 and "r3" not in _texts(corpus.TextDataset(train, None, 8, "text"))


def test_chunked_scan_finds_every_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 16 bytes: lines cross chunk ends, and one line is longer than a chunk.
    monkeypatch.setattr(corpus, "_CHUNK", 16)
    lines = [f"line {i}" for i in range(30)] + ["x" * 50, "last"]
    (tmp_path / "train.txt").write_text("\n".join(lines))
    train = corpus.index(corpus.split_files(tmp_path, "train"))
    assert _texts(corpus.TextDataset(train, None, 8, "text")) == lines


def test_bad_data_is_named_with_file_and_offset(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DataDirError, match="no training text"):
        corpus.splits(tmp_path, 0.1)
    (tmp_path / "train.jsonl").write_text('{"body": "x"}\nnot json\n')
    train, _ = corpus.splits(tmp_path, 0.5)
    ds = corpus.TextDataset(corpus.index([tmp_path / "train.jsonl"]), None, 8, "text")
    with pytest.raises(DataDirError, match=r"train.jsonl: the record at byte 0 has no string "
                                           r"field 'text'"):
        ds.text(0)
    with pytest.raises(DataDirError, match="at byte 14 is not JSON"):
        ds.text(1)
    monkeypatch.setattr(corpus, "MAX_RECORD_BYTES", 10)
    (tmp_path / "train.jsonl").write_text("short\n" + "y" * 11 + "\n")
    with pytest.raises(DataDirError, match="a record of 11 bytes .* is over 10"):
        corpus.splits(tmp_path, 0.5)


def test_items_are_padded_token_ids_with_masked_labels(lm_data: Path) -> None:
    s = parse({"model_dir": str(lm_data / "model"), "seq_len": 40})
    tok = load_tokenizer(s)
    train, _ = corpus.splits(lm_data / "node-1", 0.1)
    ds = corpus.TextDataset(train, tok, s.seq_len, s.text_field)
    item = ds[0]
    words = ds.text(0).split()
    assert item["input_ids"].shape == (40,)
    assert tok.convert_ids_to_tokens(item["input_ids"][: len(words)].tolist()) == words
    assert item["attention_mask"].sum() == len(words)
    assert (item["labels"][len(words):] == -100).all()
    assert torch.equal(item["labels"][: len(words)], item["input_ids"][: len(words)])


def test_streams_through_forked_dataloader_workers(lm_data: Path) -> None:
    # Each worker reads with pread on descriptors it opens itself: no shared file position.
    s = parse({"model_dir": str(lm_data / "model"), "seq_len": 33})
    train, _ = corpus.splits(lm_data / "node-2", 0.1)
    ds = corpus.TextDataset(train, load_tokenizer(s), s.seq_len, s.text_field)
    ds.text(0)  # a descriptor opened in the parent before the fork must not confuse workers
    batches = list(DataLoader(ds, batch_size=16, num_workers=2))
    ids = torch.cat([b["input_ids"] for b in batches])
    assert ids.shape == (len(ds), 33)
    assert torch.equal(ids[5], ds[5]["input_ids"]) and torch.equal(ids[-1], ds[len(ds) - 1][
        "input_ids"])
