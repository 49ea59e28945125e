"""A site's text, streamed from its files into fixed-length token sequences.

Layout of a node's data directory (any of these; `fedgpu data synth-lm` writes the first):

    train.jsonl | train.txt | train/*.jsonl, train/*.txt      the training split
    test.jsonl  | test.txt  | test/*.jsonl,  test/*.txt       the held-out split (optional)

A JSONL line is one JSON object whose `text_field` (default "text") is a string; a .txt line is
one example; blank lines are skipped. Without a test split, every round(1/eval_fraction)-th
record is held out. Nothing is read into memory up front: the files are scanned once for line
offsets (a few bytes per record), and each item is read (os.pread: no shared file position
between DataLoader workers), parsed and tokenised when the DataLoader asks for it.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fedgpu.node.data import DataDirError

SUFFIXES = (".jsonl", ".txt")
# One example larger than this is a data problem (a whole book on one line), not a record.
MAX_RECORD_BYTES = 1 << 20
MAX_FILES = 10_000
_CHUNK = 64 << 20
_WHITESPACE = np.frombuffer(b" \t\r\n\v\f", np.uint8)


@dataclass(frozen=True)
class Records:
    """Where each record of a split is: file index, byte offset, byte length."""

    files: tuple[Path, ...]
    file_idx: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.file_idx.shape[0])

    def take(self, mask: np.ndarray) -> Records:
        return Records(self.files, self.file_idx[mask], self.offset[mask], self.length[mask])


def split_files(data_dir: Path, split: str) -> list[Path]:
    data_dir = Path(data_dir)
    found = [data_dir / f"{split}{s}" for s in SUFFIXES if (data_dir / f"{split}{s}").is_file()]
    sub = data_dir / split
    if sub.is_dir():
        found += sorted(p for p in sub.iterdir() if p.suffix in SUFFIXES and p.is_file())
    if len(found) > MAX_FILES:
        raise DataDirError(f"{data_dir}: {len(found)} {split} files, over {MAX_FILES}: "
                           f"concatenate them")
    return found


def index(files: list[Path]) -> Records:
    """Line offsets of every non-blank line of `files` (one pass, no parsing)."""
    idx, off, length = [], [], []
    for i, path in enumerate(files):
        starts, ends = _lines(path)
        too_long = np.flatnonzero(ends - starts > MAX_RECORD_BYTES)
        if too_long.size:
            raise DataDirError(f"{path}: a record of {int((ends - starts)[too_long[0]])} bytes "
                               f"(line starting at byte {int(starts[too_long[0]])}) is over "
                               f"{MAX_RECORD_BYTES}: split it")
        idx.append(np.full(starts.shape, i, dtype=np.int32))
        off.append(starts)
        length.append((ends - starts).astype(np.int32))
    if not idx:
        return Records((), *(np.zeros(0, dtype=d) for d in (np.int32, np.int64, np.int32)))
    return Records(tuple(files), np.concatenate(idx), np.concatenate(off),
                   np.concatenate(length))


def _lines(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) byte offsets of the lines of `path` holding something but whitespace.

    Scanned in chunks that end on a line break, so memory stays a few bytes per record plus
    one chunk, whatever the file's size.
    """
    starts, ends = [], []
    try:
        if path.stat().st_size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            size, pos = len(mm), 0
            while pos < size:
                stop = min(size, pos + _CHUNK)
                if stop < size:
                    nl = mm.rfind(b"\n", pos, stop)
                    if nl < 0:  # one line longer than a chunk: take it whole
                        nl = mm.find(b"\n", stop)
                    stop = size if nl < 0 else nl + 1
                buf = np.frombuffer(mm, np.uint8, count=stop - pos, offset=pos)
                breaks = np.flatnonzero(buf == 0x0A)
                s = np.concatenate(([0], breaks + 1)).astype(np.int64)
                e = np.concatenate((breaks, [buf.size])).astype(np.int64)
                s, e = s[s < buf.size], e[s < buf.size]  # nothing after a final line break
                if s.size:
                    solid = np.add.reduceat(~np.isin(buf, _WHITESPACE), s, dtype=np.int64)
                    starts.append(s[solid > 0] + pos)
                    ends.append(e[solid > 0] + pos)
                del buf  # a view of the map: it must go before the map closes
                pos = stop
    except OSError as exc:
        raise DataDirError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(starts), np.concatenate(ends)


def splits(data_dir: Path, eval_fraction: float) -> tuple[Records, Records]:
    """(train, held-out) records of a node's data directory."""
    train_files = split_files(data_dir, "train")
    if not train_files:
        raise DataDirError(f"{data_dir} holds no training text: train.jsonl, train.txt or "
                           f"train/*.jsonl|*.txt ('fedgpu data synth-lm' writes an example)")
    train = index(train_files)
    test_files = split_files(data_dir, "test")
    if test_files:
        test = index(test_files)
    else:
        every = max(2, round(1 / eval_fraction))
        held = np.arange(len(train)) % every == every - 1
        train, test = train.take(~held), train.take(held)
    for name, recs in (("training", train), ("held-out", test)):
        if len(recs) == 0:
            raise DataDirError(f"{data_dir}: the {name} split has no non-blank record")
    return train, test


class TextDataset(Dataset[dict[str, torch.Tensor]]):
    """Records tokenised on demand into `seq_len` tokens: input_ids, attention_mask, labels.

    Every item has the same length (padded, truncated) because the runner's DataLoader stacks
    them with the default collate; padded positions carry label -100 and count in no loss.
    """

    def __init__(self, records: Records, tokenizer: Any, seq_len: int, text_field: str) -> None:
        self.records = records
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.text_field = text_field
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.records)

    def text(self, i: int) -> str:
        r = self.records
        f = int(r.file_idx[i])
        path = r.files[f]
        fd = self._fds.get(f)
        if fd is None:
            fd = self._fds[f] = os.open(path, os.O_RDONLY)
        raw = os.pread(fd, int(r.length[i]), int(r.offset[i]))
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataDirError(f"{path}: the record at byte {int(r.offset[i])} is not UTF-8"
                               ) from None
        if path.suffix == ".txt":
            return line.strip()
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DataDirError(f"{path}: the record at byte {int(r.offset[i])} is not JSON: "
                               f"{exc}") from None
        value = obj.get(self.text_field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            raise DataDirError(f"{path}: the record at byte {int(r.offset[i])} has no string "
                               f"field {self.text_field!r} (set text_field in the job's "
                               f"hyperparameters)")
        return value

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(self.text(i), truncation=True, max_length=self.seq_len,
                             padding="max_length", return_tensors="pt")
        ids = enc["input_ids"][0]
        mask = enc["attention_mask"][0]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0,
                                                                                    -100)}

    def __del__(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
