"""A local task of a few questions (train.jsonl, test.jsonl), so that a test can evaluate a whole
eval split with the shipped tiny model in a second instead of its 500 test items."""

import json
from pathlib import Path


def write_small_task(folder: Path, train: int = 8, test: int = 5) -> Path:
    """folder/{train,test}.jsonl: "n apples plus 2" questions in the default columns (answer n + 2)."""
    folder.mkdir(parents=True)
    for split, count in (("train", train), ("test", test)):
        lines = [json.dumps({"question_zh-cn": f"小明有{n}个苹果，又买了2个，一共几个？", "answer_only": n + 2})
                 for n in range(1, count + 1)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder
