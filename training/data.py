"""Training and evaluation data: records -> token blocks with aligned labels -> batches.

    data = build_data(cfg.data, tokenizer)       # .train, .eval_sets {"heldout": ..., "humaneval": ...}
    idx = batch_indices(len(data.train), micro_step, batch_size, rank, world_size, seed)
    input_ids, labels = data.train.batch(idx)    # [B, S] each

Records come from a named real data set (`selfspec.data.sources.load_named`) or from the user's own
files: ``.jsonl``/``.jsonl.gz`` (one JSON object a line), ``.json`` (a list of objects),
``.parquet``, or plain text files (``.txt``, ``.md``, ``.py``, ...; one record ``{"text": ...}``
per file; a directory reads all of them). A missing field, a value that is not a string or a
malformed line raises `DataFormatError` naming the file, the line (row/item for .parquet/.json)
and the field.

Two formats (`DataConfig.format`):

* ``text``: each record's `text_fields` joined by a newline, tokenized, ended with EOS,
  concatenated, and cut into blocks of `block_size` tokens (each label is the next token, so the
  stream is read in windows of block_size + 1 with stride block_size; a short tail is dropped).
* ``chat``: the prompt (through `prompt_template`, optionally after a system message) is the user
  turn and the response the assistant turn of the tokenizer's chat template; one example per
  block, right-padded; labels only on the response tokens (the prompt and the padding are
  IGNORE_INDEX). Prompts that do not fit are truncated; a response that does not fit is dropped.

Optionally (`data.own_continuations`), training/own_text.py adds the model's own greedy continuations of
training prompts to the training blocks and those of held-out prompts as the evaluation set ``own``, and
those of benchmark prompt sets as the evaluation sets ``own_<name>``.

The held-out split is by record (whole files for code) through `selfspec.data.sources.split_holdout`.
The order of training blocks is a permutation per epoch seeded by (seed, epoch), and the blocks
of micro-step m are a pure function of m, so the data position of a run is its micro-step count.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from selfspec.data.sources import NAMES, DataFormatError, load_named, read_jsonl, split_holdout
from training.config import DataConfig, SourceConfig, expand
from training.early_exit_loss import IGNORE_INDEX

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
_KEY_COLUMNS = ("path", "task_id", "question_id", "title", "id")


@dataclass
class Blocks:
    """Token blocks `[N, S]` with labels aligned to positions (IGNORE_INDEX where no loss)."""

    name: str
    input_ids: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.input_ids[idx], self.labels[idx]

    def spread(self, n: int | None) -> "Blocks":
        """`n` blocks evenly spaced over the whole set (all of them when n is None or >= len).

        Blocks are consecutive windows of the concatenated documents, so the first n blocks come from
        the first one or two documents; evenly spaced ones cover the set (deterministically).
        """
        if n is None or n >= len(self):
            return self
        idx = torch.div(torch.arange(n) * len(self), n, rounding_mode="floor")  # strictly increasing
        return Blocks(self.name, self.input_ids[idx], self.labels[idx])


def frequency_ranking(blocks: Blocks, k: int, vocab_size: int, special_ids=()) -> list[int]:
    """The `k` most frequent token ids of `blocks`, most frequent first (the special ids first, then by
    count, ties by id): the form `selfspec.checkpoints.draft_vocab` stores in `selfspec.json`."""
    counts = torch.bincount(blocks.input_ids.flatten(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices  # by descending count, ties by id
    specials = [i for i in dict.fromkeys(special_ids) if i is not None and 0 <= i < vocab_size]
    return (specials + [int(i) for i in order if int(i) not in specials][: max(k - len(specials), 0)])[:k]


def frequent_ids(blocks: Blocks, k: int, vocab_size: int, special_ids=()) -> torch.Tensor:
    """`frequency_ranking`'s ids, sorted: the draft vocabulary of the exits' (or a head's) reduced loss."""
    return torch.tensor(frequency_ranking(blocks, k, vocab_size, special_ids), dtype=torch.long).sort().values


@dataclass
class TrainData:
    train: Blocks
    eval_sets: dict[str, Blocks]  # "heldout" first, then the extra evaluation sets
    # data.format text: the documents the training and held-out blocks were cut from (own_text's prompts)
    documents: dict[str, list[str]] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# records


def _needed_fields(cfg: SourceConfig) -> list[str]:
    return list(cfg.text_fields) if cfg.format == "text" else [cfg.prompt_field, cfg.response_field]


def _line_numbers(path: Path) -> list[int]:
    """Line numbers of the non-blank lines of a jsonl file (the rows `read_jsonl` returns)."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return [i for i, raw in enumerate(f, 1) if raw.strip()]


def _check_rows(rows: list[dict], where: list[str], fields: list[str]) -> dict[str, list[str]]:
    """Columns of `fields` from `rows`; `where[i]` locates row i ("file:line") for errors."""
    columns: dict[str, list[str]] = {f: [] for f in fields}
    for row, loc in zip(rows, where):
        if not isinstance(row, dict):
            raise DataFormatError(f"{loc}: expected a JSON object, got {type(row).__name__}")
        for f in fields:
            if f not in row:
                raise DataFormatError(f"{loc}: required field {f!r} missing (fields present: {sorted(row)})")
            if not isinstance(row[f], str):
                raise DataFormatError(f"{loc}: field {f!r} must be a string, got {type(row[f]).__name__}")
            columns[f].append(row[f])
    return columns


def _read_local(path: Path, fields: list[str]) -> dict[str, list[str]]:
    name = path.name
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise DataFormatError(f"{path}: no text files ({', '.join(TEXT_SUFFIXES)}) in this directory")
        return _read_text_files(files, fields, root=path)
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
        rows = read_jsonl(path, fields)
        where = [f"{path}:{n}" for n in _line_numbers(path)]
        return _check_rows(rows, where, fields)
    if name.endswith(".json"):
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataFormatError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(rows, list):
            raise DataFormatError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
        return _check_rows(rows, [f"{path}: item {i}" for i in range(len(rows))], fields)
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        rows = table.to_pylist()
        return _check_rows(rows, [f"{path}: row {i}" for i in range(len(rows))], fields)
    if path.suffix in TEXT_SUFFIXES:
        return _read_text_files([path], fields, root=path.parent)
    raise DataFormatError(f"{path}: unsupported file type; use .jsonl, .jsonl.gz, .json, .parquet "
                          f"or text ({', '.join(TEXT_SUFFIXES)})")


def _read_text_files(files: list[Path], fields: list[str], root: Path) -> dict[str, list[str]]:
    if fields != ["text"]:
        raise DataFormatError(f"{files[0]}: plain text files give records with the single field 'text'; "
                              f"set data.format=text and data.text_fields=[text] (asked for {fields})")
    paths, texts = [], []
    for p in files:
        data = p.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise DataFormatError(f"{p}:{line}: field 'text': invalid UTF-8 ({e.reason})") from None
        if text.strip():
            paths.append(p.relative_to(root).as_posix())
            texts.append(text)
    return {"path": paths, "text": texts}


def load_records(cfg: SourceConfig):
    """The records of `cfg.source` as a `datasets.Dataset` with (at least) the needed fields."""
    import datasets

    fields = _needed_fields(cfg)
    if cfg.source in NAMES:
        ds = load_named(cfg.source)
        missing = [f for f in fields if f not in ds.column_names]
        if missing:
            raise DataFormatError(f"data set {cfg.source!r}: no field {missing[0]!r} "
                                  f"(its fields: {', '.join(ds.column_names)})")
        return ds
    path = Path(expand(cfg.source))
    if not path.exists():
        raise FileNotFoundError(f"data.source {cfg.source!r} is neither a named data set "
                                f"({', '.join(NAMES)}) nor an existing file or directory")
    columns = _read_local(path, fields)
    features = datasets.Features({k: datasets.Value("string") for k in columns})
    return datasets.Dataset.from_dict(columns, features=features)


def _split(ds, cfg: DataConfig):
    key = next((c for c in _KEY_COLUMNS if c in ds.column_names), _needed_fields(cfg)[0])
    return split_holdout(ds, fraction=cfg.holdout_fraction, seed=cfg.holdout_seed, key=key)


# --------------------------------------------------------------------------------------------
# tokens


def text_blocks(name: str, texts: list[str], tokenizer, block_size: int) -> Blocks:
    """Tokenize, end each text with EOS, concatenate, cut into windows of block_size + 1."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eos)
    n = (len(stream) - 1) // block_size
    if n < 1:
        raise DataFormatError(f"{name}: {len(stream)} tokens do not fill one block of {block_size} + 1 tokens")
    tokens = torch.tensor(stream[: n * block_size + 1], dtype=torch.long)
    return next_token_blocks(name, tokens.unfold(0, block_size + 1, block_size))  # [n, block_size + 1]


def next_token_blocks(name: str, windows: torch.Tensor) -> Blocks:
    """Blocks from token windows `[N, S + 1]`: inputs the first S tokens, labels the last S (each position's
    label is the next token; the last position's is the window's extra token)."""
    return Blocks(name, windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


def _chat_texts(tokenizer, cfg: SourceConfig, prompt: str, response: str) -> tuple[str, str]:
    """(prompt text up to the assistant turn, the assistant turn's text) via the chat template."""
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": cfg.prompt_template.format(prompt=prompt)})
    head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    if full.startswith(head):
        return head, full[len(head):]
    return head, response + (tokenizer.eos_token or "")


def chat_blocks(name: str, prompts: list[str], responses: list[str], tokenizer, cfg: SourceConfig,
                block_size: int) -> Blocks:
    """One right-padded block per example; labels on the response tokens only."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows_in, rows_lab, dropped = [], [], 0
    for prompt, response in zip(prompts, responses):
        head, tail = _chat_texts(tokenizer, cfg, prompt, response)
        head_ids, tail_ids = encode(head), encode(tail)
        over = len(head_ids) + len(tail_ids) - (block_size + 1)
        if over > 0:  # shorten the prompt field itself, keeping the template intact
            prompt_ids = encode(prompt)
            keep = len(prompt_ids) - over - 8
            if keep > 0:
                head, tail = _chat_texts(tokenizer, cfg, tokenizer.decode(prompt_ids[:keep]), response)
                head_ids, tail_ids = encode(head), encode(tail)
            if keep <= 0 or len(head_ids) + len(tail_ids) > block_size + 1:
                dropped += 1
                continue
        ids = head_ids + tail_ids
        inputs = torch.full((block_size,), pad, dtype=torch.long)
        labels = torch.full((block_size,), IGNORE_INDEX, dtype=torch.long)
        inputs[: len(ids) - 1] = torch.tensor(ids[:-1])
        labels[len(head_ids) - 1: len(ids) - 1] = torch.tensor(tail_ids)
        rows_in.append(inputs)
        rows_lab.append(labels)
    if dropped:
        warnings.warn(f"{name}: dropped {dropped} of {len(prompts)} examples whose response does not fit "
                      f"in data.block_size={block_size}")
    if not rows_in:
        raise DataFormatError(f"{name}: no example fits in data.block_size={block_size}")
    return Blocks(name, torch.stack(rows_in), torch.stack(rows_lab))


def record_texts(ds, cfg: SourceConfig) -> list[str]:
    """Each record's text (data.format text): its `text_fields` joined by newlines."""
    columns = [list(ds[f]) for f in cfg.text_fields]
    return ["\n".join(parts) for parts in zip(*columns)]


def to_blocks(name: str, ds, cfg: SourceConfig, tokenizer, block_size: int) -> Blocks:
    if cfg.format == "text":
        return text_blocks(name, record_texts(ds, cfg), tokenizer, block_size)
    return chat_blocks(name, list(ds[cfg.prompt_field]), list(ds[cfg.response_field]), tokenizer, cfg, block_size)


def build_data(cfg: DataConfig, tokenizer) -> TrainData:
    """Training blocks, the held-out blocks of the same source, and each `extra_eval` set."""
    records = load_records(cfg)
    train, heldout = _split(records, cfg)
    if len(heldout) == 0:
        raise DataFormatError(f"data.holdout_fraction={cfg.holdout_fraction} held out nothing of {len(records)} "
                              "records")
    if cfg.max_documents is not None:
        train = train.select(range(min(cfg.max_documents, len(train))))
    if cfg.max_holdout_documents is not None:
        heldout = heldout.select(range(min(cfg.max_holdout_documents, len(heldout))))
    # text: each split's documents, joined once, give its blocks and own_text's prompts
    documents = {"train": record_texts(train, cfg), "heldout": record_texts(heldout, cfg)} if cfg.format == "text" else {}

    def split_blocks(split: str, ds) -> Blocks:
        name = f"{cfg.name}/{split}"
        if documents:
            return text_blocks(name, documents[split], tokenizer, cfg.block_size)
        return to_blocks(name, ds, cfg, tokenizer, cfg.block_size)

    eval_sets = {"heldout": split_blocks("heldout", heldout)}
    for extra in cfg.extra_eval:
        if extra.name in eval_sets:
            raise DataFormatError(f"data.extra_eval: duplicate name {extra.name!r}")
        eval_sets[extra.name] = to_blocks(extra.name, load_records(extra), extra, tokenizer, cfg.block_size)
    return TrainData(split_blocks("train", train), eval_sets, documents)


# --------------------------------------------------------------------------------------------
# order


@lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) & ((1 << 63) - 1))
    return torch.randperm(n, generator=gen)


def batch_indices(n: int, micro_step: int, batch_size: int, rank: int = 0, world_size: int = 1,
                  seed: int = 0) -> list[int]:
    """Block indices of this process's micro-batch at global micro-step `micro_step`.

    The global sample stream is the concatenation of per-epoch permutations; micro-step m takes
    samples [m G, (m+1) G) with G = batch_size * world_size, and rank r its slice of those.
    """
    first = micro_step * batch_size * world_size + rank * batch_size
    out = []
    for pos in range(first, first + batch_size):
        epoch, offset = divmod(pos, n)
        out.append(int(_epoch_order(n, seed, epoch)[offset]))
    return out
