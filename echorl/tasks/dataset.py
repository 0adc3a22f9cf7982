"""Your own data and your own rewards, the way TRL takes them: a dataset file and reward
functions over its columns, by import path, summed with weights.

    [task]
    dataset = "data/train.parquet"            # .jsonl, .json, .csv, .parquet, or a datasets folder
    rewards = ["rewards.py:correct", "rewards.py:short"]
    reward_weights = [1.0, 0.2]
    eval_dataset = "data/test.jsonl"          # or eval_fraction = 0.1

    # rewards.py
    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

Each function is called as `fn(prompts, completions, **columns)` with lists (here of one: a
completion is scored as the broker receives it, under the verifier pool's time and memory
limits) and returns a list of floats (None: this reward does not apply, counted 0). The
`prompt` column is a string, or a list of chat messages rendered by the model's chat
template; with messages, `prompts` and `completions` are passed as messages too, as TRL
passes a conversational dataset. Every other column reaches the functions by its name.

Held-out rows (evaluation) are `eval_dataset`'s, or `eval_fraction` of the rows chosen by a
hash of their prompt, or (neither set) one in eight by the same rule as every task. A
`completion` (or `answer`) column, when present, is the warm-up's demonstration.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from echorl.tasks.base import Problem
from echorl.userpath import load_callable

FILE_KINDS = (".jsonl", ".json", ".csv", ".parquet")
DEMONSTRATION_COLUMNS = ("completion", "answer", "solution")


@dataclass(frozen=True)
class DatasetSpec:
    """What `task.dataset` and its neighbours say; its JSON is the task's spec string."""

    dataset: str
    rewards: tuple[str, ...]
    reward_weights: tuple[float, ...] | None = None
    eval_dataset: str | None = None
    eval_fraction: float | None = None
    prompt_column: str = "prompt"
    max_new_tokens: int = 256

    def spec(self) -> str:
        return "data:" + json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def parse(cls, spec: str) -> DatasetSpec:
        fields = json.loads(spec.removeprefix("data:"))
        fields["rewards"] = tuple(fields["rewards"])
        if fields.get("reward_weights") is not None:
            fields["reward_weights"] = tuple(fields["reward_weights"])
        return cls(**fields)


def read_rows(path: str) -> list[dict]:
    """Every row of a JSONL/JSON/CSV/Parquet file, or of a local `datasets` folder
    (`save_to_disk`: a Dataset, or a DatasetDict's `train` split), as dicts."""
    where = Path(path)
    if where.is_dir():
        try:
            import datasets
        except ImportError:
            raise ValueError(
                f"{path}: a datasets folder needs the datasets package (pip install echorl[data])"
            ) from None
        data = datasets.load_from_disk(str(where))
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise ValueError(f"{path}: a DatasetDict without a 'train' split ({list(data)})")
            data = data["train"]
        return data.to_list()
    if not where.is_file():
        raise ValueError(f"{path}: no such file or folder")
    kind = where.suffix.lower()
    if kind == ".jsonl":
        rows = []
        for i, line in enumerate(where.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON: {e.msg}") from None
        return rows
    if kind == ".json":
        rows = json.loads(where.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json dataset is a list of objects")
        return rows
    if kind in (".csv", ".parquet"):
        try:
            import pyarrow.csv
            import pyarrow.parquet
        except ImportError:
            raise ValueError(f"{path}: {kind} needs pyarrow (pip install echorl[data])") from None
        read = pyarrow.csv.read_csv if kind == ".csv" else pyarrow.parquet.read_table
        return read(str(where)).to_pylist()
    raise ValueError(f"{path}: a dataset is a {', '.join(FILE_KINDS)} file or a datasets folder")


@dataclass(eq=False)
class DatasetTask:
    """A dataset's rows as problems (`problem(seed)` is row `seed % rows`) scored by the
    weighted sum of reward functions. `tally` adds up each reward's values as they are
    computed (the verifier worker reads and clears it: each reward's mean is logged)."""

    spec: DatasetSpec
    reward_range: tuple[float, float] = (-1e6, 1e6)  # a reward function's own scale, kept
    tally: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))

    def __post_init__(self) -> None:
        s = self.spec
        if not s.rewards:
            raise ValueError("task.rewards: a dataset needs at least one reward function")
        if s.reward_weights is not None and len(s.reward_weights) != len(s.rewards):
            raise ValueError(
                f"task.reward_weights: {len(s.reward_weights)} weights for {len(s.rewards)} rewards"
            )
        self.functions = [load_callable(r, "task.rewards") for r in s.rewards]
        self.weights = list(s.reward_weights or [1.0] * len(s.rewards))
        self.reward_names = _short_names(s.rewards)
        self.rows  # noqa: B018  (read and checked now, not at the first prompt)
        self.max_new_tokens = s.max_new_tokens

    @cached_property
    def name(self) -> str:
        """The data's and the rewards' identity, not their paths: the same file in two
        folders is one task; another reward or weight is another."""
        digest = hashlib.sha256(json.dumps(self.rows, sort_keys=True, default=str).encode())
        rewards = ",".join(f"{r}*{w:g}" for r, w in zip(self.reward_names, self.weights))
        return f"data:{Path(self.spec.dataset).stem}@{digest.hexdigest()[:12]}[{rewards}]"

    @cached_property
    def rows(self) -> list[tuple[dict, bool]]:
        """(row, held out) for every row: the training file's, then the eval file's."""
        s, column = self.spec, self.spec.prompt_column
        train = read_rows(s.dataset)
        held = read_rows(s.eval_dataset) if s.eval_dataset else []
        for path, rows in ((s.dataset, train), (s.eval_dataset, held)):
            for i, row in enumerate(rows, 1):
                if not isinstance(row, dict) or column not in row:
                    raise ValueError(
                        f"{path}: row {i} has no {column!r} column (task.prompt_column)"
                    )
                if not _prompt_ok(row[column]):
                    raise ValueError(
                        f"{path}: row {i}'s {column!r} is neither text nor a list of chat "
                        "messages ({'role': ..., 'content': ...})"
                    )
        if not train:
            raise ValueError(f"{s.dataset} holds no rows")
        if s.eval_dataset:
            if not held:
                raise ValueError(f"{s.eval_dataset} holds no rows")
            return [(r, False) for r in train] + [(r, True) for r in held]
        marked = [(r, self._held_out(_text(r[column]))) for r in train]
        if all(h for _, h in marked) or not any(h for _, h in marked):
            raise ValueError(
                f"{s.dataset}: {len(train)} rows leave "
                f"{'no training' if all(h for _, h in marked) else 'no held-out'} rows at "
                "this split: set task.eval_dataset, or another task.eval_fraction"
            )
        return marked

    def _held_out(self, prompt: str) -> bool:
        bucket = zlib.crc32(prompt.encode())
        if self.spec.eval_fraction is None:
            return bucket % 8 == 0  # base.HELDOUT_BUCKETS, as every task splits
        return bucket % 10_000 < self.spec.eval_fraction * 10_000

    @cached_property
    def splits(self) -> tuple[list[dict], list[dict]]:
        """The training rows and the held-out rows."""
        return [r for r, h in self.rows if not h], [r for r, h in self.rows if h]

    def problem(self, seed: int) -> Problem:
        # Even seeds draw a training row, odd ones a held-out row: each split has half the
        # seed space whatever its size (in one list, 10 training rows beside 10,000 held
        # out made a training draw 1 in 1,000, and the broker's draws of one job ran out).
        rows = self.splits[seed % 2]
        held, row = bool(seed % 2), rows[(seed // 2) % len(rows)]
        prompt = row[self.spec.prompt_column]
        columns = {k: v for k, v in row.items() if k != self.spec.prompt_column}
        data = {"columns": columns, "heldout": held}
        if isinstance(prompt, list):
            data["messages"] = prompt
        answer = next((str(row[c]) for c in DEMONSTRATION_COLUMNS if c in row), "")
        return Problem(self.name, seed, _text(prompt), answer, data)

    def score(self, problem: Problem, completion: str) -> float:
        """The weighted sum of the rewards (None counts 0), each one's value tallied."""
        conversational = "messages" in problem.data
        prompts = [problem.data["messages"] if conversational else problem.prompt]
        answer = [{"role": "assistant", "content": completion}] if conversational else completion
        columns = {k: [v] for k, v in problem.data["columns"].items()}
        total = 0.0
        for fn, w, name in zip(self.functions, self.weights, self.reward_names):
            values = fn(prompts=prompts, completions=[answer], **columns)
            if not isinstance(values, (list, tuple)) or len(values) != 1:
                raise ValueError(f"reward {name} returned {values!r}, not a list of one float")
            if values[0] is None:
                continue
            value = float(values[0])
            if not math.isfinite(value):
                raise ValueError(f"reward {name} returned {value!r}")
            kept = self.tally[name]
            kept[0], kept[1] = kept[0] + value, kept[1] + 1
            total += w * value
        return total

    def drain_tally(self) -> dict[str, tuple[float, int]]:
        """Each reward's (sum, count) since the last drain."""
        out = {k: (s, n) for k, (s, n) in self.tally.items()}
        self.tally.clear()
        return out

    def demonstration(self, problem: Problem) -> str:
        if not problem.answer:
            raise ValueError(
                f"{self.spec.dataset}: the warm-up needs a demonstration column "
                f"({' or '.join(DEMONSTRATION_COLUMNS)}); this dataset has none"
            )
        return problem.answer


def _prompt_ok(prompt) -> bool:
    if isinstance(prompt, str):
        return bool(prompt)
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt)
    )


def _text(prompt) -> str:
    """A prompt as one string (messages: their contents, a line each): what the held-out
    split hashes and what logs show; the model sees messages through the chat template."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def _short_names(specs: tuple[str, ...]) -> list[str]:
    """A reward's name in the metrics: its function's name, or the whole spec when two share it."""
    names = [s.rpartition(":")[2] for s in specs]
    return [n if names.count(n) == 1 else s for n, s in zip(names, specs)]
