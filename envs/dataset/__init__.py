"""Dataset environment: tasks from the rows of a local file (JSONL, Parquet, CSV, or what `datasets` loads)."""

from envs.dataset.answers import AnswerMatch, FunctionReward, final_answer, normalize
from envs.dataset.draws import Split
from envs.dataset.env import DatasetEnv
from envs.dataset.rows import TaskFileError, TaskRow, read_rows

__all__ = [
    "AnswerMatch",
    "DatasetEnv",
    "FunctionReward",
    "Split",
    "TaskFileError",
    "TaskRow",
    "final_answer",
    "normalize",
    "read_rows",
]
